# Test-only, not a kernel package: pure-torch stand-ins for the two sgl_kernel
# CPU ops SGLang's CPU engine imports unconditionally (cache_move.py,
# allocation.py); PyPI has only CUDA builds of sgl_kernel. Any other name
# imports as a function that raises when called.
import ctypes
import torch

__version__ = "0.0.0+probe"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset,
                                 end_offset, out_cache_loc, max_len):
    pt = 0
    for i in range(req_pool_indices.shape[0]):
        r = int(req_pool_indices[i]); s = int(start_offset[i]); e = int(end_offset[i])
        req_to_token[r, s:e] = out_cache_loc[pt:pt + (e - s)].to(req_to_token.dtype)
        pt += e - s


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in zip(tgt_loc.tolist(), src_loc.tolist()):
            ctypes.memmove(ptr + t * stride, ptr + s * stride, stride)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*a, **k):
        raise NotImplementedError(f"sgl_kernel probe stub: {name} called")

    missing.__name__ = name
    return missing
