"""``vllm_generate.py`` in vLLM's ``AMX_MLA`` engine configuration, on a CPU without AMX tiles:
a configuration run, not AMX tiles.

    python vllm_generate_amx.py <vllm_generate.py's arguments>

Before vLLM is imported, ``torch.cpu._is_amx_tile_supported`` is made to answer True, so that
vLLM's CPU platform configures an MLA engine as it does on an AMX machine
(vllm/platforms/cpu.py): ``AMX_MLA`` as the attention backend, chunked prefill and prefix
caching left on, the MLA layers' absorb / de-absorb through ``AMXMLAImpl``'s packed weights.
attnhub's ``cpu`` backend reads the same probe (``attnhub_cpu.ops.detect``), so in this process
it takes its ``AMX_MLA`` path too. What runs is the same code as on an AMX machine, but the
kernels (oneDNN's brgemm ukernel in ``decode_attention_cpu`` / ``extend_attention_cpu`` /
``bmm_cpu``, vLLM's SGL GEMMs) run their AVX512-BF16 code path, not AMX tiles: this checks the
engine configuration and the adapter, never AMX's numerics or speed. Without AVX512-BF16 those
kernels do not run: :func:`refusal` says so first.

Two more differences from ``vllm_generate.py``, for prefills with cached context: prefix caching
on (``vllm_generate.py`` passes ``enable_prefix_caching=False``; vLLM's CPU platform leaves it
on with ``AMX_MLA``), and prompts that share a prefix (:func:`shared_prefix_prompts`), so later
prompts hit the prefix cache and prefill over cached context, besides chunked prefill's own.
"""

from __future__ import annotations

import os
import sys

import torch

#: Tokens every prompt starts with: 3 blocks of 32 (AMX_MLA's block size here), a prefix-cache
#: hit of whole blocks for every prompt after the first to be computed.
SHARED_PREFIX = 96
#: The rest of each prompt (10 prompts, as ``vllm_generate.PROMPT_LENS``).
TAIL_LENS = (3, 17, 45, 130, 60, 9, 70, 100, 33, 150)


def refusal() -> str | None:
    """Why this CPU cannot run the configuration, or None: vLLM's ``AMX_MLA`` ops need x86 with
    AVX512-BF16 where no AMX tiles are there (the cpu backend's tests call them so)."""
    if not torch.cpu._is_avx512_bf16_supported():
        return "no AVX512-BF16: AMX_MLA's kernels have no code path for this CPU without AMX"
    return None


def shared_prefix_prompts(seed: int = 1) -> list[list[int]]:
    """10 prompts: one shared random prefix of ``SHARED_PREFIX`` tokens, then random tails."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 1000, (SHARED_PREFIX,), generator=g).tolist()
    return [prefix + torch.randint(3, 1000, (n,), generator=g).tolist() for n in TAIL_LENS]


def configure() -> None:
    """vLLM believes this CPU has AMX tiles (before it is imported), prefix caching is on and
    the prompts share a prefix."""
    torch.cpu._is_amx_tile_supported = lambda: True  # a configuration run: no AMX tiles
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import vllm
    import vllm_generate

    base = vllm.LLM

    class LLM(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["enable_prefix_caching"] = True  # as vLLM's CPU platform leaves it for AMX_MLA
            super().__init__(*args, **kwargs)

    vllm.LLM = LLM  # type: ignore[misc]
    try:  # attnhub's cpu backend reads the same probe: it takes its AMX_MLA path here
        from attnhub_cpu import mla_ops, ops
    except ImportError:
        pass
    else:
        features = ops.detect()
        print(
            f"attnhub_cpu detects {features.name}: MLA through {mla_ops.vllm_mla_backend(features)}"
        )
    assert len(TAIL_LENS) == len(vllm_generate.PROMPT_LENS)
    vllm_generate.prompts = shared_prefix_prompts


if __name__ == "__main__":
    why = refusal()
    if why is not None:
        print(f"AMX_MLA configuration run not possible here: {why}", file=sys.stderr)
        sys.exit(3)
    configure()
    import vllm_generate

    sys.exit(vllm_generate.main())
