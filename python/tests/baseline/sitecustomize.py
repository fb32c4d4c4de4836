"""Lets vLLM's Mooncake connectors (the baselines) run on a CPU-only machine.

Put this directory on the engines' PYTHONPATH (`Engine(pythonpath=[...])`).
With PyPI's CUDA build of torch and no NVIDIA driver:

- `torch.accelerator.current_device_index()`, which MooncakeConnector's
  worker calls once, raises "Found no NVIDIA driver"; without CUDA the
  answer is device 0.
- `torch.cuda.Event().record()`, which MooncakeStoreConnector's worker
  calls in `wait_for_save` to fence its saves behind the forward (its send
  thread then calls `.synchronize()`), raises the same; on the CPU the
  forward has finished when `wait_for_save` runs, so an event that is
  always complete is exact.
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

if torch is not None and not torch.cuda.is_available():

    class _CompletedEvent:
        """`torch.cuda.Event` for work that is synchronous: always done."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

        def wait(self, stream: object = None) -> None:
            pass

    torch.cuda.Event = _CompletedEvent
