"""Rewards: scoring completions with TRL-style functions (runner), what a function may return (values),
the worker processes user code runs in (sandbox, usercode), reward models (models) and reward services
over HTTP (remote, serve)."""

from esft.rewards.remote import RemoteReward, RewardServiceError, remote_reward
from esft.rewards.runner import RewardError, RewardFunc, RewardRunner, Scores

__all__ = ["RemoteReward", "RewardError", "RewardFunc", "RewardRunner", "RewardServiceError", "Scores", "remote_reward"]
