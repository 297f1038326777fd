"""The codec's per-element work on the tensor's own device: ``DeviceTensor``, the torch twin of
``host_agent.local.HostTensor`` (numpy), for CUDA tensors on the ``homagg`` backend.

The agent runs the rounds as for any tensor (``Agent.allreduce_detailed``); a ``DeviceTensor``
answers its questions with torch operations where the tensor lives, so only the words cross
PCIe: round 1's words (the block words and split flags, with the flat bitmap, n/32 words,
for the flat index; the hierarchical index's levels are built here, and only the top level
and the union's mid and leaf words cross), the split round's, the value round's (u words on
the union, n when dense, the sketch's counters) and the sums coming back.

Bit for bit the numpy codec's: the same words in every round and the same float sums, so a
job may mix CPU and GPU workers. What makes it so:

- every product by a power of two is exact in float64 (the power built from its bits), and
  rounding is torch.round's, half to even as numpy's rint; a sum is rounded once to the
  output's dtype, from its exact value;
- exponents are frexp's, of float64 values, as numpy's;
- bitmaps are packed as ``codec.kernels.pack`` does: tensor bit i at bit 7 - i % 8 of byte
  i // 8, the bytes read as little-endian uint32 words.

The sketch's hashes (splitmix64, uint64 arithmetic) run in int64, whose products wrap to
the same bits, with logical shifts by a mask; its counters are summed in int64, exactly. Its
peeling stays on the host, where the switch's sums arrive. The tests run this module on cpu
tensors against the numpy codec (tests/test_device_codec.py); ``bench/gpu_check.py`` on a
GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from homagg.host_agent import codec
from homagg.host_agent.codec import Mode, _ref
from homagg.host_agent.codec.blocks import MAX_OFFSET, SPLIT_BINADES, SPLIT_RUN
from homagg.host_agent.codec.errors import AggregationOverflow, CodecError
from homagg.host_agent.codec.index import SUBS
from homagg.host_agent.codec.quantization import INT32_MAX, INT32_MIN
from homagg.host_agent.codec.sketch import K_HASHES, _check_size, _seeds
from homagg.host_agent.local import Round1, Scales

#: Bit weights of a byte's 8 elements, first element in the top bit (numpy's packbits).
_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


class DeviceTensor:
    """A worker's float tensor on its own device, for ``Agent.allreduce_detailed``; its
    ``Result.out`` is a tensor of ``dtype`` (float32 or float64) on the same device.
    bfloat16 and float16 are widened to float32 first (exactly)."""

    def __init__(self, t: torch.Tensor, dtype: torch.dtype | None = None):
        x = t.detach().reshape(-1)
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        if x.dtype not in (torch.float32, torch.float64):
            raise CodecError(f"expected a floating-point tensor, got {t.dtype}")
        self.x = x
        self.n = x.numel()
        self.device = x.device
        self.dtype = dtype or x.dtype
        self._pos: torch.Tensor | None = None      # the union's positions, on the device
        self._bits: torch.Tensor | None = None     # the non-zero bitmap (int32 words), there
        # the sketch's quantized non-zeros: positions (int64) and words (int32), on the device
        self._sparse: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- round 1 ---------------------------------------------------------------------------
    def round1(self, block: int, split: bool, words: bool = True) -> Round1:
        """One trip to the host: the words are built on the device with the max exponent as
        a device value (no sync before them), and come back with the tensor's peak. The
        flat bitmap stays on the device unless ``words`` asks for it (the hierarchical index
        builds its levels there: ``levels``)."""
        x, n, dev = self.x, self.n, self.device
        nb = codec.block_count(n, block)
        nbw = codec.bitmap_words(nb)
        mag = _padded(x.abs(), nb * block).view(nb, block)
        peaks = mag.amax(1) if n else torch.zeros(0, dtype=x.dtype, device=dev)
        peak = peaks.amax().double() if n else torch.zeros((), dtype=torch.float64, device=dev)
        pe = torch.frexp(peaks.double())[1].long()
        e = torch.frexp(peak)[1].long()
        use = torch.isfinite(peak) & (peak > 0)  # else: no scales (all zero, or a NaN/Inf)
        blocks = _wrap32(torch.where(use & (peaks > 0), 1 << (e - pe).clamp(0, MAX_OFFSET), 0))
        if split and block >= SPLIT_RUN:
            flags = _pack(self._split_mask(mag, pe, block) & use)
        else:
            flags = torch.zeros(nbw, dtype=torch.int32, device=dev)
        parts = [peak.reshape(1).view(torch.int32), blocks, flags]
        if words:  # (a dense round sends none; the hierarchy builds its levels here)
            parts.append(self._bitmap())
        host = _host(torch.cat(parts), unsigned=True)
        top = float(host[:2].view(np.float64)[0])
        finite = math.isfinite(top)
        e_host = math.frexp(top)[1] if finite and top > 0 else None
        return Round1(n, finite, e_host, host[2:2 + nb], host[2 + nb:2 + nb + nbw],
                      host[2 + nb + nbw:] if words else None)

    def levels(self) -> _Levels:
        """The hierarchical index's levels of round 1's bitmap, built on the device; only
        the top level and the rounds' words cross to the host."""
        return _Levels(self._bitmap(), self.n)

    def _bitmap(self) -> torch.Tensor:
        """The flat non-zero bitmap (int32 words, on the device), built once when asked."""
        if self._bits is None:  # NaN != 0: a NaN's position is set, as numpy's
            self._bits = _pack(self.x != 0)
        return self._bits

    @staticmethod
    def _split_mask(mag: torch.Tensor, pe: torch.Tensor, block: int) -> torch.Tensor:
        """Per block: ``SPLIT_RUN`` consecutive non-zeros each below 2**(e_peak - 1 -
        ``SPLIT_BINADES``) (``codec.blocks.split_flags``)."""
        # 2**k in the tensor's own dtype compares as in float64: exact where float32 holds
        # 2**k, and where it does not (k < -149: 0, k > 127: inf) the comparison is the same
        limit = torch.ldexp(torch.ones_like(pe, dtype=torch.float64),
                            pe - 1 - SPLIT_BINADES).to(mag.dtype)
        small = (mag != 0) & (mag < limit[:, None])
        k = block - SPLIT_RUN + 1  # windows of SPLIT_RUN elements in a block
        run = small[:, :k].clone()
        for j in range(1, SPLIT_RUN):
            run &= small[:, j:j + k]
        return run.any(1)

    def element_words(self, positions: np.ndarray, e: int | None) -> np.ndarray:
        if e is None or not positions.size:
            return np.zeros(positions.size, np.uint32)
        v = self.x[torch.from_numpy(np.asarray(positions, np.int64)).to(self.device)]
        ee = torch.frexp(v.abs().double())[1].long()
        return _host(_wrap32(torch.where(v != 0, 1 << (e - ee).clamp(0, MAX_OFFSET), 0)),
                     unsigned=True)

    # -- the value rounds ------------------------------------------------------------------
    def value_words(self, mode, scales: Scales, union_words: np.ndarray | None,
                    union: np.ndarray | None, seed: int, ratio: float,
                    alloc: Callable[[int, Any], np.ndarray] = np.empty) -> np.ndarray:
        # (``alloc`` is the host's: these words are made on the device and copied in one trip)
        if mode == Mode.DENSE or union_words is None:
            shifts = self._shifts(scales)
            q, bad = _quantize_lazy(self.x, shifts)
            host = _host(torch.cat([q, bad.sum().reshape(1).int()]))  # one trip
            if host[-1]:
                _refuse(self.x, shifts, bad)
            return host[:-1]
        if mode == Mode.UNION:
            pos = self._union(union_words)
            v = self.x[pos]
            shifts = self._shifts(scales, pos)
            q, bad = _quantize_lazy(v, shifts)
            # one trip: the words, then this worker's non-zeros and how many of them the
            # union kept, then how many values left int32
            host = _host(torch.cat([q, torch.stack([torch.count_nonzero(self.x),
                                                    torch.count_nonzero(v), bad.sum()]).int()]))
            mine, kept, out = (int(c) for c in host[-3:])
            if mine != kept:
                raise CodecError("worker's support is not contained in the union bitmap")
            if out:
                _refuse(v, shifts, bad, pos)
            return host[:-3]
        assert union is not None  # mode sketch: the union listed, on the host
        idx = torch.nonzero(self.x).reshape(-1)
        val = _quantize(self.x[idx], self._shifts(scales, idx), idx)
        self._sparse = (idx, val)
        self._union(union_words)
        return _sketch_encode(idx, val, codec.sketch_size(union.size, ratio), seed)

    def residual_words(self, positions: np.ndarray) -> np.ndarray:
        """The residual round's words: this worker's values at the unresolved ``positions``
        (``codec.residual_values``), looked up on the device."""
        assert self._sparse is not None
        idx, val = self._sparse
        if not idx.numel() or not positions.size:
            return np.zeros(positions.size, np.int32)
        pos = _device(np.asarray(positions, np.int64), self.device)
        hit = torch.searchsorted(idx, pos).clamp(max=idx.numel() - 1)
        return _host(torch.where(idx[hit] == pos, val[hit], 0).to(torch.int32))

    def decode(self, values: np.ndarray, scales: Scales, mode, union_words: np.ndarray | None,
               union: np.ndarray | None, dtype) -> torch.Tensor:
        v = _device(values, self.device).double()
        if union_words is None:
            return (v * _pow2(-self._shifts(scales))).to(dtype)
        pos = self._union(union_words)
        if pos.numel() != v.numel():
            raise CodecError("union bitmap and values disagree on the union size")
        out = torch.zeros(self.n, dtype=dtype, device=self.device)
        out[pos] = (v * _pow2(-self._shifts(scales, pos))).to(dtype)
        return out

    def nan(self, dtype) -> torch.Tensor:
        return torch.full((self.n,), math.nan, dtype=dtype, device=self.device)

    # -- helpers ---------------------------------------------------------------------------
    def _union(self, union_words: np.ndarray) -> torch.Tensor:
        """The union's positions (sorted int64, on the device), from the ORed bitmap; its
        size is counted on the host, so listing them needs no sync."""
        if self._pos is None:
            words = codec.scan.checked_words(union_words, self.n)
            mask = _unpack(_device(words.view(np.int32), self.device), self.n)
            self._pos = _nonzero(mask, codec.union_size(words, self.n))
        return self._pos

    def _shifts(self, scales: Scales, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The shifts (int64, on the device) of every element, or of sorted ``positions``."""
        lo = min(int(scales.blocks().min(initial=0)), int(scales.at_shifts().min(initial=0))
                 if scales.at is not None else 0)
        hi = max(int(scales.blocks().max(initial=0)), int(scales.at_shifts().max(initial=0))
                 if scales.at is not None else 0)
        if lo < -1022 or hi > 1022:
            raise CodecError(f"scale shifts {lo}..{hi} leave float64's normal range: the "
                             "device codec takes shifts in -1022..1022")
        blocks = _device(scales.blocks(), self.device)
        if positions is None:
            out = blocks.repeat_interleave(scales.block)[:self.n]
            if scales.at is not None:
                out[torch.from_numpy(scales.at).to(self.device)] = torch.from_numpy(
                    scales.at_shifts()).to(self.device)
            return out
        out = blocks[positions // scales.block]
        if scales.at is not None and scales.at.size and positions.numel():
            at = torch.from_numpy(scales.at).to(self.device)
            k = torch.searchsorted(at, positions).clamp(max=at.numel() - 1)
            own = torch.from_numpy(scales.at_shifts()).to(self.device)
            out = torch.where(at[k] == positions, own[k], out)
        return out


class _Levels:
    """``codec.Levels`` of a bitmap on the device (the same words, bit for bit): a byte of
    the flat bitmap is a sub-block (8 elements), 16 bytes a block; ``top`` is round 1's
    words (one bit per block), ``mid`` and ``leaf`` the next rounds' for the union's blocks
    and sub-blocks (host arrays, as ``codec.Levels``' are)."""

    def __init__(self, bits: torch.Tensor, n: int):
        self.n = n
        nb = codec.top_bits(n)
        self.flat = _padded(bits.view(torch.uint8)[:-(-n // 8)], SUBS * nb)
        self.sub = _pack(self.flat != 0).view(torch.uint8)[:2 * nb]  # 2 bytes a block
        self.top = _host(_pack(self.sub.view(nb, 2).ne(0).any(1)), unsigned=True)

    def mid(self, blocks: np.ndarray) -> np.ndarray:
        """Round 2's words: this worker's 16 sub-block bits of each union block, in order."""
        return _byte_words(self.sub.view(-1, 2)[_positions(blocks, self.sub.device)]
                           .reshape(-1))

    def leaf(self, subs: np.ndarray) -> np.ndarray:
        """Round 3's words: this worker's 8 element bits of each union sub-block, in order."""
        return _byte_words(self.flat[_positions(subs, self.flat.device)])


def _positions(at: np.ndarray, device: torch.device) -> torch.Tensor:
    """Block or sub-block numbers (each below n / 8) on the device: int32 across PCIe."""
    return _device(np.asarray(at, np.int32), device).long()


def _byte_words(b: torch.Tensor) -> np.ndarray:
    """Device bytes as host uint32 words, zero-padded (``codec.index._words``)."""
    return _host(_padded(b, -(-b.numel() // 4) * 4).view(torch.int32), unsigned=True)


def _padded(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` (1-D) zero-padded to ``size`` elements."""
    if x.numel() == size:
        return x
    out = torch.zeros(size, dtype=x.dtype, device=x.device)
    out[:x.numel()] = x
    return out


_weights: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        w = _weights[device] = torch.tensor(_WEIGHTS, dtype=torch.uint8, device=device)
    return w


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask packed as ``codec.kernels.pack`` does, as int32 words (their bits)."""
    w = codec.bitmap_words(mask.numel())
    b = _padded(mask.to(torch.uint8), 32 * w).view(-1, 8)
    return (b * _bit_weights(mask.device)).sum(1, dtype=torch.uint8).view(torch.int32)


def _unpack(words: torch.Tensor, n: int) -> torch.Tensor:
    """The first n bits of packed int32 words, as a bool mask."""
    b = words.view(torch.uint8)
    return ((b[:, None] & _bit_weights(words.device)) != 0).reshape(-1)[:n]


def _wrap32(w: torch.Tensor) -> torch.Tensor:
    """Words in [0, 2**32) (int64) as int32 with the same bits."""
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _host(t: torch.Tensor, unsigned: bool = False) -> np.ndarray:
    """Device int32 values on the host (``unsigned``: their bits as uint32 words). From a
    GPU through pinned memory: a buffer of torch's caching host allocator, which takes it
    back for reuse once the array is gone; one wait, on this thread's stream."""
    if t.is_cuda:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        a = buf.numpy()
    else:
        a = t.cpu().numpy()
    return a.view(np.uint32) if unsigned else a


def _device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host words on ``device``. To a GPU through a pinned buffer (torch's caching host
    allocator keeps it until the copy is done), without waiting for the copy."""
    src = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return src.to(device)
    buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    buf.copy_(src)
    return buf.to(device, non_blocking=True)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e (float64) exactly, built from its bits, for integer e in [-1022, 1022]
    (``DeviceTensor._shifts`` checks)."""
    return ((e + 1023) << 52).view(torch.float64)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions (int64) of the ``count`` set elements of a bool mask."""
    static = getattr(torch, "nonzero_static", None)
    if static is not None:
        try:
            return static(mask, size=count).reshape(-1)
        except (RuntimeError, NotImplementedError):  # a device without it: with a sync
            pass
    return torch.nonzero(mask).reshape(-1)


def _quantize_lazy(v: torch.Tensor, shifts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 rint(v * 2**shifts), as ``codec.quantize``, and (on the device) which values left
    int32 or were not finite: their words are 0, and ``_refuse`` names the first."""
    q = torch.round(v.double() * _pow2(shifts))
    bad = ~torch.isfinite(q) | (q > INT32_MAX) | (q < INT32_MIN)
    return torch.where(bad, 0, q).to(torch.int32), bad


def _refuse(v: torch.Tensor, shifts: torch.Tensor, bad: torch.Tensor,
            positions: torch.Tensor | None = None) -> None:
    """CodecError naming the first bad value's index in the tensor (``positions[i]`` for
    value i), as ``codec.quantize`` does."""
    i = int(torch.nonzero(bad)[0])
    at = int(positions[i]) if positions is not None else i
    x, s = float(v[i]), int(shifts[i])
    if not math.isfinite(x):
        raise CodecError(f"tensor has a non-finite value ({x}) at index {at}", index=at)
    raise CodecError(f"value {x} at index {at} is out of int32 range at shift {s}: use "
                     "shift_for()", index=at)


# The sketch's hashes (``codec._ref.hashes``) in int64: the same bits as its uint64
# arithmetic (products wrap alike; a right shift is made logical by a mask).
_M1, _M2, _M3 = (int(np.array(c, np.uint64).view(np.int64)) for c in (_ref.M1, _ref.M2, _ref.M3))


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """uint64 ``x >> k`` (0 < k < 64) on int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (``codec._ref._mix``)."""
    x = x ^ _srl(x, 30)
    x = x * _M2
    x = x ^ _srl(x, 27)
    x = x * _M3
    return x ^ _srl(x, 31)


def _sketch_encode(idx: torch.Tensor, val: torch.Tensor, m: int, seed: int) -> np.ndarray:
    """``codec.sketch_encode`` of the non-zeros ``idx`` (sorted int64) and their words ``val``
    on the device: its hashes, and the counters summed exactly in int64."""
    if m == 0:
        return np.zeros(0, np.int32)
    _check_size(m)
    part = m // K_HASHES
    s1, s2 = (int(np.array(v, np.uint64).view(np.int64)) for v in _seeds(seed))
    base = idx * _M1
    a, b = _mix(base + s1), _mix(base + s2)
    counters = torch.zeros(m, dtype=torch.int64, device=idx.device)
    v = val.long()
    for j, word in enumerate((_srl(a, 32), a & 0xFFFFFFFF, _srl(b, 32))):
        pos = _srl(word * part, 32) + j * part
        sign = ((b if j == 0 else _srl(b, j)) & 1) * 2 - 1
        counters.index_add_(0, pos, sign * v)
    bad = (counters > INT32_MAX) | (counters < INT32_MIN)
    host = _host(torch.cat([torch.where(bad, 0, counters).to(torch.int32),
                            bad.sum().reshape(1).int()]))
    if host[-1]:
        raise AggregationOverflow("sketch-encode", torch.nonzero(bad).reshape(-1).cpu().numpy())
    return host[:-1]


def _quantize(v: torch.Tensor, shifts: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """``_quantize_lazy``, raising at once for a bad value."""
    q, bad = _quantize_lazy(v, shifts)
    if bool(bad.any()):
        _refuse(v, shifts, bad, positions)
    return q
