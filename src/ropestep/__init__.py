"""ropestep: exact gradient-step verification of RoPE-softmax attention."""
__version__ = "0.1.0"
