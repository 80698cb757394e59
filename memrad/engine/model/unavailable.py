"""The one error a model that cannot be loaded or fetched raises (pull, the GGUF readers, the
served context), in a module of its own so each of them imports it without the others."""


class ModelUnavailable(RuntimeError):
    """The model cannot be loaded or fetched; the message says what to run."""
