"""Lets vLLM's MooncakeConnector (the baseline) run on a CPU-only machine.

Put this directory on the engines' PYTHONPATH (`Engine(pythonpath=[...])`).
With PyPI's CUDA build of torch and no NVIDIA driver,
`torch.accelerator.current_device_index()`, which the connector's worker
calls once, raises "Found no NVIDIA driver"; without CUDA the answer is
device 0.
"""

try:
    import torch
except ImportError:  # not an engine's interpreter: nothing to patch
    torch = None

if torch is not None and hasattr(torch, "accelerator"):
    _current_device_index = torch.accelerator.current_device_index

    def current_device_index() -> int:
        if not torch.cuda.is_available():
            return 0
        return _current_device_index()

    torch.accelerator.current_device_index = current_device_index
