"""Entry points for trainers that build the optimizer themselves (``hf``: Hugging Face
``transformers.Trainer``)."""
