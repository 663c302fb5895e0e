"""esft: fine-tune Hugging Face causal LMs with Evolution Strategies (arXiv 2509.24372)."""

from esft.settings.config import ESConfig

__all__ = ["ESConfig", "ESTrainer", "GRPOBaseline", "RandOptTrainer"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The trainer imports torch and transformers; load it only when asked for.
    if name == "ESTrainer":
        from esft.trainer import ESTrainer

        return ESTrainer
    if name == "GRPOBaseline":  # TRL's GRPOTrainer behind ESTrainer's interface (pip install 'esft[grpo]')
        from esft.grpo.baseline import GRPOBaseline

        return GRPOBaseline
    if name == "RandOptTrainer":  # --algorithm randopt: N perturbations scored once, the best K voting
        from esft.randopt.trainer import RandOptTrainer

        return RandOptTrainer
    raise AttributeError(name)
