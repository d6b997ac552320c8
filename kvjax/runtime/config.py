"""One frozen engine configuration: every setting an ``Engine`` is built from, checked once, here.

``kvjax.generate``, ``kvjax-infer`` (through it) and ``kvjax-serve`` build one the same way and hand it to
``Engine``; the runner and the server read it back from ``engine.config``. A later option (quantized pages,
eviction) is a field here, so it has one home and one check. ``for_machine`` fills what the caller left open with
the defaults of the machine at hand (``kvjax.machine``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvjax import machine, validate
from kvjax.eviction.metrics import WINDOWED
from kvjax.eviction.select import Eviction, parse
from kvjax.ops.attention import check_backend
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.kv_schemes import page_of, served
from kvjax.ops.quant import GROUP

PAGE = 16  # tokens a page of the cache's dtype (a quantized page: ``quant.GROUP``)
# The entry points' ``kv_bits`` (``kvjax.generate``, ``kvjax-infer``, ``kvjax-serve``): 4 or 2, a GEAR name
# ("gear2-r1-o0.01", ``kv_schemes.served``), None (pages of the cache's dtype, whatever the model asks for) or
# "model", their default: the model's own choice, ``Model.kv_bits``, saved with its checkpoint. ``EngineConfig`` and
# ``Engine`` take no "model": the caller resolves it (``kv_bits_for``).
KvBits = int | str | None | Literal["model"]


def kv_bits_for(model, kv_bits: KvBits) -> int | str | None:
    """The engine's ``kv_bits`` for ``model``: "model" stands for ``model.kv_bits``; anything else is as given (and
    checked by ``EngineConfig``)."""
    if isinstance(kv_bits, str) and kv_bits == "model":
        return getattr(model, "kv_bits", None)
    return kv_bits


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (``Engine``'s docstring says what each does); invalid values are one-line errors at
    construction, before any memory is taken."""

    # sequences decoded at once (--max-batch); None: the machine's, ``machine.default_max_batch`` (32 on a GPU, 4 on a
    # CPU), resolved at construction as every entry point resolves it
    max_batch: int = None  # type: ignore[assignment]
    max_seq_len: int = 512  # cache positions a sequence may fill: prompt + new tokens
    # tokens a page; None: 16, or quant.GROUP (32, the keys' quantization group) with kv_bits, resolved at construction
    page_size: int = None  # type: ignore[assignment]
    chunk_tokens: int = 512  # prompt tokens prefilled a step
    num_pages: int | None = None  # the whole-context pool's pages; or sized by cache_memory
    cache_memory: float | int | None = None  # a fraction of the memory free, or bytes
    cache_dtype: str | None = None  # default: the model's
    backend: str | None = None  # "pallas", "reference", "interpret"; default by device
    batch_invariant: bool = False
    decode_config: DecodeConfig = DECODE
    prefill_min_tokens: int | None = None
    prefill_max_rows: int | None = None
    # quantized pages: 4 or 2 bits (``kvjax.ops.quant``) or a GEAR name (``kvjax.ops.gear``, its canonical form after
    # construction: ``kv_schemes.served``); None keeps the cache's dtype
    kv_bits: int | str | None = None
    # eviction after each prompt (issue 37): an ``eviction.Eviction`` or its short form ("kvcompress:4x",
    # "snapkv:256", "h2o:4x"): any of ``metrics.METHODS``, the full-history ones accumulated over each prompt's chunks
    # (``eviction.prompt.accumulate``); None keeps every token. Its page size becomes the engine's after construction.
    eviction: Eviction | str | None = None
    # devices the model is split over (``kvjax.parallel``: KV heads placed by bytes, Megatron-style weights); 1: one
    tensor_parallel: int = 1
    # which device holds each KV head: "bytes" (balanced by bytes per token) or "even" (the same count in order: the
    # baseline ``bench/engine.py --placement even`` measures against)
    head_placement: str = "bytes"
    # share the pages of identical prefixes (``runtime.prefix``): None wherever the cache can (not with eviction,
    # sliding-window layers, quantized pages or batch_invariant), True insists (refused where it cannot), False off
    prefix_caching: bool | None = None

    def __post_init__(self):
        self._defaults()
        for name in ("max_batch", "max_seq_len", "page_size", "chunk_tokens"):
            validate.positive(name, getattr(self, name))
        for name in ("prefill_min_tokens", "prefill_max_rows"):
            if getattr(self, name) is not None:
                validate.positive(name, getattr(self, name))
        self._check_budget()
        if self.cache_dtype is not None:
            object.__setattr__(self, "cache_dtype", validate.dtype(self.cache_dtype))
        if self.backend is not None:
            check_backend(self.backend)
        validate.flag("batch_invariant", self.batch_invariant)
        self.prefix_caching is None or validate.flag("prefix_caching", self.prefix_caching)
        validate.positive("tensor_parallel", self.tensor_parallel)
        if self.head_placement not in ("bytes", "even"):
            raise ValueError(f"head_placement must be 'bytes' or 'even', got {self.head_placement!r}")
        if not isinstance(self.decode_config, DecodeConfig):
            raise TypeError(f"decode_config must be a DecodeConfig, got {type(self.decode_config).__name__}")
        if self.eviction is not None:
            self._check_eviction(engine_eviction(self.eviction, self.page_size))
        if self.tensor_parallel > 1 and isinstance(self.kv_bits, str):
            raise ValueError(
                f"kv_bits {self.kv_bits} with tensor_parallel={self.tensor_parallel} is not supported yet (GEAR's "
                "outliers and residual are taken over a device's padded heads, which changes them); 4 or 2 bits are"
            )

    def _check_budget(self) -> None:
        """num_pages or cache_memory, each valid, never both."""
        if self.num_pages is not None:
            if self.cache_memory is not None:
                raise ValueError("give num_pages or cache_memory, not both")
            validate.integer("num_pages", self.num_pages, low=2)
        if self.cache_memory is not None:
            validate.memory_budget("cache_memory", self.cache_memory)

    def _check_eviction(self, eviction: Eviction) -> None:
        """Keep ``eviction`` (parsed, its pages the engine's), or refuse it in one line beside these settings."""
        object.__setattr__(self, "eviction", eviction)
        if eviction.method in WINDOWED and eviction.window > self.chunk_tokens:
            raise ValueError(
                f"eviction {eviction.name} scores each prompt from its last window of {eviction.window} queries, "
                f"which a step's chunk_tokens={self.chunk_tokens} cannot hold"
            )
        if self.kv_bits is not None and not isinstance(self.kv_bits, int):
            raise ValueError(
                f"eviction {eviction.name} with kv_bits {self.kv_bits}: evicting serves KIVI-style 4 or 2 bits only"
            )

    def _defaults(self) -> None:
        """Fields whose default depends on others, filled in (the instance is frozen, hence ``object.__setattr__``)."""
        if self.max_batch is None:
            object.__setattr__(self, "max_batch", machine.default_max_batch())
        if self.kv_bits is not None:
            object.__setattr__(self, "kv_bits", served(self.kv_bits))
        fixed = page_of(self.kv_bits)  # a GEAR name's -p<tokens>: its streaming buffer is the page
        if fixed is not None and self.page_size not in (None, fixed):
            raise ValueError(f"kv_bits {self.kv_bits} stores pages of {fixed} tokens; page_size={self.page_size} given")
        if self.page_size is None:
            object.__setattr__(self, "page_size", fixed or (GROUP if self.kv_bits else PAGE))

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_machine(cls, context: int, *, max_batch: int | None = None, max_seq_len: int | None = None, **settings):
        """A configuration whose batch and positions a sequence, where not given, fit the machine at hand: 32
        sequences of up to 8192 positions on a GPU, ``machine.CPU_MAX_BATCH`` of up to ``machine.CPU_MAX_SEQ_LEN``
        on a CPU (where a step's cost follows both), never past the model's ``context``."""
        cpu = machine.platform() == "cpu"
        return cls(
            max_batch=max_batch,  # type: ignore[arg-type]  # None: the machine's (resolved at construction)
            max_seq_len=max_seq_len or min(context, machine.CPU_MAX_SEQ_LEN if cpu else machine.GPU_MAX_SEQ_LEN),
            **settings,
        )


def engine_eviction(eviction: Eviction | str, page_size: int = PAGE) -> Eviction:
    """The engine's eviction policy from ``EngineConfig.eviction``, its pages the engine's."""
    if isinstance(eviction, str):
        eviction = parse(eviction)
    elif not isinstance(eviction, Eviction):
        raise TypeError(f"eviction must be an Eviction or a string such as 'kvcompress:4x', got {eviction!r}")
    return dataclasses.replace(eviction, page_size=page_size)
