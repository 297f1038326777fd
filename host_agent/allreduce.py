"""The host agent: a reliable, packetized all-reduce through the switch's slot pool.

    agent = Agent(AgentConfig(job=1, worker=0, workers=4, switch=("10.0.0.254", 48864),
                              bind=("10.0.0.1", 50000), slots=64))
    total = agent.allreduce(grad)          # fp32 in, fp32 out: the exact sum of quantized values

Per tensor (DESIGN.md section 1): one OR round carrying the job's scale negotiation (a one-hot
exponent per worker: the OR gives the max) and the index of the non-zeros: the flat bitmap, or
the top level of the hierarchical one, whose two further OR rounds follow (``codec.index``;
``AgentConfig.index`` and ``codec.choose_index`` pick one per tensor, from the tensor's
previous union size when its ``key`` has been seen). Then the values, as the byte count
decides (``codec.choose_mode``): dense, on the union, or sketch + residual. A tensor that went
dense under ``auto`` skips the index next time (same ``key``). Every round goes through the
agent's ``Transport`` (slots, retransmission, deadline). An overflow flagged by the switch
makes every worker (they all see the same flag) redo the value rounds with a smaller scale:
never a wrapped sum. Every decision (index, mode, skipped rounds) comes from what the switch
returned or from such earlier results, so every worker takes the same one without a message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from homagg import wire
from homagg.host_agent import codec
from homagg.host_agent.codec import AUTO, Mode
from homagg.host_agent.config import AgentConfig, AgentError
from homagg.host_agent.transport import SwitchOverflow, Transport

log = logging.getLogger("homagg.agent")


@dataclass
class Counters:
    packets_sent: int = 0
    bytes_sent: int = 0
    retransmissions: int = 0
    results: int = 0
    ignored: int = 0          # late duplicates, foreign or malformed datagrams
    rounds: int = 0
    rescales: int = 0
    seconds: float = 0.0


@dataclass
class Result:
    """One all-reduce: the float sum, and the exact integers behind it."""

    out: np.ndarray
    shift: int
    mode: Mode
    n: int
    union_words: np.ndarray | None  # ORed non-zero bitmap the values are on (None: dense)
    values: np.ndarray         # exact integer sums, per union rank (union: the switch's int32
                               # words; sketch: int64), or dense int64
    wire_bytes: int            # homagg payload bytes this worker sent (retransmissions too)
    rounds: dict = field(default_factory=dict)  # words sent per round: index ("bitmap" or
                               # "index-top/mid/leaf", without the exponent words), values
    _union: np.ndarray | None = field(default=None, repr=False, compare=False)
    index: str | None = None   # "flat" or "hier"; None: no index round (dense remembered)

    @property
    def union(self) -> np.ndarray | None:
        """Positions the values are on (None: dense), listed on first use only."""
        if self.union_words is None:
            return None
        if self._union is None:
            self._union = codec.union_indices(self.union_words, self.n)
        return self._union

    def ints(self) -> np.ndarray:
        """The exact integer sum as a dense int64 array."""
        if self.union_words is None:
            return self.values.astype(np.int64)
        full = np.zeros(self.n, np.int64)
        full[self.union] = self.values
        return full


def _exponent_words(e: int | None) -> np.ndarray:
    """A worker's max exponent e as one bit (e + EXP_BIAS) of EXP_WORDS words; the OR of every
    worker's gives the job's max (``_max_exponent``)."""
    onehot = np.zeros(wire.EXP_WORDS, np.uint32)
    if e is not None:
        b = e + wire.EXP_BIAS
        onehot[b // 32] = np.uint32(1 << (31 - b % 32))
    return onehot


def _max_exponent(words: np.ndarray) -> int | None:
    bits = np.unpackbits(words.astype(">u4").view(np.uint8))
    hits = np.flatnonzero(bits)
    return None if hits.size == 0 else int(hits[-1]) - wire.EXP_BIAS


class Agent:
    def __init__(self, config: AgentConfig):
        self.cfg = config
        self.counters = Counters()
        self.transport = Transport(config, self.counters)
        self.seed = config.job if config.seed is None else config.seed
        self._last_mode: dict = {}
        self._last_union: dict = {}  # key -> union size u last time (codec.choose_index)

    @property
    def sock(self):
        """The socket to the switch (an ``ImpairedSocket`` with fault injection)."""
        return self.transport.sock

    @property
    def switch(self) -> tuple[str, int]:
        """The switch's resolved address."""
        return self.transport.switch

    def close(self) -> None:
        self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stream(self, op: int, words: np.ndarray) -> np.ndarray:
        """One round through the switch (``Transport.stream``)."""
        return self.transport.stream(op, words)

    # -- all-reduce ----------------------------------------------------------------------------
    def allreduce_int(self, q: np.ndarray) -> np.ndarray:
        """Dense int32 sum, bit for bit; AgentError if the switch flags an overflow."""
        q = np.ascontiguousarray(q, np.int32).reshape(-1)
        try:
            return self.transport.stream(wire.OP_ADD, q)
        except SwitchOverflow:
            raise AgentError(f"{self.cfg.who}: int32 overflow in the sum") from None

    def allreduce(self, x: np.ndarray, key=None) -> np.ndarray:
        """The sum over workers of ``x`` (float), exact on the quantized values."""
        return self.allreduce_detailed(x, key).out.reshape(np.shape(x))

    def allreduce_detailed(self, x: np.ndarray, key=None) -> Result:
        cfg = self.cfg
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise AgentError(f"{cfg.who}: allreduce wants floats, got {x.dtype} "
                             "(use allreduce_int for integers)")
        out_dtype = x.dtype
        flat = x.reshape(-1)
        n = flat.size
        before = self.counters.bytes_sent
        try:
            scan = codec.Scan.of(flat)
            e = scan.max_exponent()
        except codec.CodecError as err:
            # Every worker must still take part in the round, or its peers hang: say so loudly.
            raise AgentError(f"{cfg.who}: {err}; this worker stops, and its peers will "
                             "time out on this tensor") from None
        onehot = _exponent_words(e)

        mode = codec.as_mode(cfg.mode, auto=True)
        if mode == AUTO and key is not None and self._last_mode.get(key) == Mode.DENSE:
            mode = Mode.DENSE  # last time this tensor was dense: skip the index (all agree)
        index = None
        index_rounds: dict[str, int] = {}
        u = 0
        if mode == Mode.DENSE:
            agg = self.transport.stream(wire.OP_OR, onehot).view(np.uint32)
            union_words = None
        else:
            index = codec.choose_index(cfg.index, n, self._last_union.get(key)
                                       if key is not None else None)
            agg, union_words, index_rounds = self._index_rounds(scan, onehot, index)
            u = codec.union_size(union_words, n)
            if key is not None:
                self._last_union[key] = u
            if mode == AUTO:
                mode = codec.choose_mode(n, u, index_words=sum(index_rounds.values()))
            if mode == Mode.DENSE:
                union_words = None
        # Only the sketch needs U's positions; union mode works from the bitmap itself.
        union = (codec.union_indices(union_words, n)
                 if mode == Mode.SKETCH and union_words is not None else None)
        if key is not None:
            self._last_mode[key] = mode
        e_all = _max_exponent(agg[:wire.EXP_WORDS])
        shift = codec.shift_for(e_all, cfg.workers, cfg.headroom) + cfg.shift_bias
        rounds = {}
        for _attempt in range(cfg.max_rescales + 1):
            try:
                values, rounds = self._value_rounds(flat, scan, shift, mode, union_words,
                                                    union)
                break
            except SwitchOverflow:
                self.counters.rescales += 1
                log.info("%s: overflow at shift %d, rescaling", cfg.who, shift)
                shift -= 4
            except codec.CodecError as err:  # e.g. a local value out of int32 at this scale
                self.transport.broken = str(err)
                raise AgentError(f"{cfg.who}: {err}; peers will time out on this "
                                 "tensor") from None
        else:
            raise AgentError(f"{cfg.who}: int32 overflow persists after "
                             f"{cfg.max_rescales} rescales")
        if union_words is None:
            out = np.ldexp(values.astype(np.float64), -shift).astype(out_dtype)
        elif mode == Mode.UNION:
            out = codec.decode_union(union_words, n, values, shift, out_dtype)
        else:
            assert union is not None  # mode sketch
            out = codec.assemble(n, union, values, shift, out_dtype)
        return Result(out, shift, Mode(mode), n, union_words, values,
                      self.counters.bytes_sent - before, {**index_rounds, **rounds}, union,
                      index=index)

    def _index_rounds(self, scan, onehot, index):
        """Round 1 (exponent words and the flat bitmap or the top level) and, for ``hier``, the
        mid and leaf rounds: (round 1's ORed words, the flat union bitmap, words per index
        round)."""
        stream = self.transport.stream
        if index == codec.FLAT:
            agg = stream(wire.OP_OR, np.concatenate([onehot, scan.words])).view(np.uint32)
            union_words = agg[wire.EXP_WORDS:]
            return agg, union_words, {codec.ROUND_FLAT: union_words.size}
        levels = codec.Levels.of(scan.words, scan.n)
        agg = stream(wire.OP_OR, np.concatenate([onehot, levels.top])).view(np.uint32)
        union_words, sent = codec.hier_rounds(
            [levels], agg[wire.EXP_WORDS:],
            lambda words: stream(wire.OP_OR, words[0]).view(np.uint32))
        return agg, union_words, sent

    def _value_rounds(self, flat, scan, shift, mode, union_words, union):
        """The value round (and the residual): exact sums, on the union (int32 words from the
        switch in mode union, int64 for the sketch) or dense (int64). An empty union (every
        worker sees it) sends nothing."""
        stream = self.transport.stream
        if mode == Mode.DENSE or union_words is None:
            q = codec.quantize(flat, shift)
            return stream(wire.OP_ADD, q).astype(np.int64), {"dense": q.size}
        s = scan.quantize(shift)
        if mode == Mode.UNION:  # straight from the bitmap: U is never listed
            words = codec.encode_union(s, union_words)
            if not words.size:  # an empty union, on every worker: nothing to send
                return words, {}
            return stream(wire.OP_ADD, words), {str(mode): words.size}
        if not union.size:
            return np.zeros(0, np.int64), {}
        words = codec.encode_values(s, union, mode, self.seed)
        agg = stream(wire.OP_ADD, words)
        peeled = codec.decode_values(agg, union, mode, self.seed)
        values, left = peeled.values, peeled.unresolved
        rounds = {str(mode): words.size}
        if left.size:
            resid = stream(wire.OP_ADD, codec.residual_values(s, union[left]))
            values = values.copy()
            values[left] = resid
            rounds["residual"] = left.size
        codec.check_int32(values, mode)
        return values, rounds
