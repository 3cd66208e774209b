"""The simulator: a stand-in SGLang (``simulator``), simulated GPUs (``simgpu``) and their
probe (``gpuprobe``), a load generator (``loadgen``) and the demo (``demo``).

Held to the real SGLang by ``tests/real/test_conformance.py``: where they disagree, the
simulator is wrong. Installed with the ``[sim]`` extra. The product never imports it; the
CLI reaches it only through ``supervisor/cli/registry.py``.
"""
