"""Fused Triton LM-head kernels (argmax, Gumbel-max sampling, verification) and their noise.

Named `flashspec.kernels`, never top-level `kernels`, which is Hugging Face's own package.
"""
