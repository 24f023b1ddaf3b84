"""The in-process transformers engine: generation and capture of aux hidden states in this process."""
