"""Models as users hold them: a GGUF file made into a safetensors folder once (gguf), and pretrained
models that esft prepares offline from a package registry (prepared)."""
