"""Generation engine: the `GenerationMixin` subclass, the speculative loop and the drafters."""
