"""Weights in and out: the `.ninfer` artifact, the Hugging Face checkpoint and config readers,
the converter, the loader (artifact -> device params) and the embedded tiny model."""
