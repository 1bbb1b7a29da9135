"""Tools around the engine, not the engine itself (vLLM keeps `vllm bench` the same way):

* edit_cost.py: the fused kernels with and without logit edit codes (issue 30's GPU bar,
  `python -m flashspec.bench.edit_cost`).
* demo.py: the main job, stock transformers next to flashspec on a model pair
  (`python -m flashspec`, or `python -m flashspec.bench.demo`).
* cli.py: argparse types, run metadata and progress shared by the scripts in scripts/.
* prompt_sets.py: the shipped prompt sets (load, format with the chat template, encode).
* random_init.py: offline models at real shapes, random weights from the shipped configs.
* statistics.py: the statistical test kit (chi-squared with pooled bins, KS, acceptance z-test).
"""
