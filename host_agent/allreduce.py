"""The host agent: a reliable, packetized all-reduce through the switch's slot pool.

    agent = Agent(AgentConfig(job=1, worker=0, workers=4, switch=("10.0.0.254", 48864),
                              bind=("10.0.0.1", 50000), slots=64))
    total = agent.allreduce(grad)          # fp32 in, fp32 out: the exact sum of quantized values

Per tensor (docs/agent.md): one OR round carrying the job's scale negotiation (a one-hot
exponent per worker: the OR gives the max; bit 0 of those words says "I have a NaN or an Inf";
then, dense or flat, one word per block of ``AgentConfig.block`` elements, the block's offset
below the tensor max: ``codec.blocks``) and the index of the non-zeros: the flat bitmap, or
the top level of the hierarchical one, whose two further OR rounds follow (``codec.index``;
``AgentConfig.index`` and ``codec.choose_index`` pick one per tensor, from the tensor's
previous union size when its ``key`` has been seen). Then the values, as the byte count
decides (``codec.choose_mode``): dense, on the union, or sketch + residual. A tensor that went
dense under ``auto`` skips the index next time (same ``key``). Every round goes through the
agent's ``Transport`` (slots, retransmission, deadline). An overflow flagged by the switch
makes every worker (they all see the same flag) redo the value rounds with a smaller scale:
never a wrapped sum (every block's shift goes down together). The words of round 1 and the
index rounds are host_agent/negotiation.py's; the agent decides what they carry.

Scales are per block (block floating point, ``codec.blocks``): block k's shift is the tensor
shift plus the job's offset for k. With the hierarchical index the block words ride in the mid
round instead, only for the blocks the union's top level touches (an empty tensor sends none).
The block words carry the blocks' split flags (one bit per block): a block that holds a run of
values far below its peak on some worker (a small layer next to a large one) is split, and
one more OR round gives each of its elements a scale of its own (``codec.blocks``).

Non-finite values: a worker whose tensor holds a NaN or an Inf sets the flag in round 1; if the
OR has it, every worker stops after round 1 (no index or value round, no timeout) and returns
NaN for the whole tensor (``Result.nonfinite``): the positions are not known to the other
workers without another round, and what AMP's ``GradScaler`` needs is a non-finite value on
every worker. Every decision (index, mode, skipped rounds) comes from what the switch
returned or from such earlier results, so every worker takes the same one without a message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from homagg import wire
from homagg.host_agent import codec
from homagg.host_agent.codec import AUTO, Mode
from homagg.host_agent.config import AgentConfig, AgentError
from homagg.host_agent.engine import Counters, SwitchLink, SwitchOverflow, Transport
from homagg.host_agent.local import HostTensor, Scales
from homagg.host_agent.negotiation import (
    HEAD_WORDS,
    Negotiation,
    Proposal,
    exponent_words,
    first_words,
    index_rounds,
    max_exponent,
)
from homagg.host_agent.pipeline import Listed, Pipeline, Served
from homagg.host_agent.result import Result, RowsResult

log = logging.getLogger("homagg.agent")


class Agent:
    """``transport``: a factory ``(config, counters) -> SwitchLink``; default the UDP
    ``Transport`` to the switch."""

    def __init__(self, config: AgentConfig,
                 transport: Callable[[AgentConfig, Counters], SwitchLink] | None = None):
        self.cfg = config
        self.counters = Counters()
        self.transport: SwitchLink = (transport or Transport)(config, self.counters)
        self.seed = config.job if config.seed is None else config.seed
        self._last_mode: dict = {}
        self._last_union: dict = {}  # key -> union size u last time (codec.choose_index)
        self._hier_saves: dict = {}  # key -> index words hier saved on that union
        # the job's round cost in words, from the last round 1 (identical on every worker)
        self._round_words: int | None = None
        # pipelining (``pipeline``): the tensors that follow, while this tensor's next round
        # may carry the next one's round 1; and a tensor whose round 1 came that way
        self._ahead: Pipeline | None = None
        self._served: Served | None = None
        self._lent = 0  # of this tensor's wire bytes, the next one's round 1's share

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
        if self.cfg.membership is not None:  # joined through the service: give the place back
            self.cfg.membership.leave()

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

    def allreduce(self, x: np.ndarray, key=None, out: np.ndarray | None = None) -> np.ndarray:
        """The sum over workers of ``x`` (float), exact on the quantized values; NaN
        everywhere if any worker's ``x`` has a NaN or an Inf. ``out``: where to write it
        (see ``allreduce_detailed``); ``out=x`` is an all-reduce in place."""
        res = (self.allreduce_detailed(x, key) if out is None  # (as before out=: a wrapper
               else self.allreduce_detailed(x, key, out=out))  # of the two arguments works)
        return res.out.reshape(np.shape(x))

    def allreduce_rows(self, n_rows: int, rows: np.ndarray, values: np.ndarray, key=None
                       ) -> RowsResult:
        """A row-sparse all-reduce (a torch sparse COO gradient, e.g. of an embedding table):
        this worker's ``values`` (one row of floats per entry of ``rows``: sorted, unique row
        numbers < ``n_rows``). First the union of every worker's rows, by OR rounds of a row
        bitmap (flat, or the hierarchical index: ``AgentConfig.index``); then the sum of the
        values on that union, one ``allreduce_detailed`` of U x (row size) floats, exact on
        the quantized values as any tensor. Nothing dense as the table is ever made: the
        bitmap has a bit per row, the values a row per union row."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        values = np.asarray(values)
        if values.shape[0] != rows.size:
            raise AgentError(f"{self.cfg.who}: {rows.size} rows but {values.shape[0]} value "
                             "rows")
        if rows.size and (rows[0] < 0 or rows[-1] >= n_rows or np.any(np.diff(rows) <= 0)):
            raise AgentError(f"{self.cfg.who}: rows must be sorted, unique and < {n_rows}")
        stream = self.transport.stream
        mine = codec.Sparse(n_rows, rows, np.ones(rows.size, np.int32))
        rkey = ("rows", key) if key is not None else None
        index = self._index(n_rows, rkey)
        if index == codec.FLAT:
            union_words = stream(wire.OP_OR, codec.bitmap(mine)).view(np.uint32)
        else:
            levels = codec.Levels.from_sparse(mine)
            top = stream(wire.OP_OR, levels.top).view(np.uint32)
            union_words, _ = codec.hier_rounds(
                [levels], top, lambda words: stream(wire.OP_OR, words[0]).view(np.uint32))
        union = codec.union_indices(union_words, n_rows)
        self._remember_union(rkey, union_words, n_rows, union.size)
        on_union = np.zeros((union.size,) + values.shape[1:], values.dtype)
        on_union[codec.ranks_in(union, rows)] = values
        try:
            res = self.allreduce_detailed(on_union.reshape(-1),
                                          ("rows-values", key) if key is not None else None)
        except AgentError as err:
            i = getattr(err, "index", None)
            if i is None:
                raise
            # an offset in the union's values: name it in the row-sparse tensor's terms
            row_size = max(1, int(np.prod(values.shape[1:], dtype=np.int64)))
            row, col = int(union[i // row_size]), i % row_size
            fail = AgentError(str(err).replace(f"at index {i}", f"at row {row}, element {col}",
                                               1))
            fail.index = row * row_size + col  # type: ignore[attr-defined]
            raise fail from None
        return RowsResult(union, res.out.reshape(on_union.shape), res)

    def allreduce_many(self, xs, keys=None, outs=None) -> list[Result]:
        """``allreduce_detailed`` of each tensor of ``xs`` in turn (``keys``, ``outs``: one
        per tensor, or None), pipelined: each tensor's round 1 rides with the one before's
        values (``pipeline``), so the list pays about one round trip a tensor. Every worker
        passes the same number of tensors, of the same sizes, in the same order; the sums
        are bit for bit those of one call per tensor."""
        xs = list(xs)
        keys = [None] * len(xs) if keys is None else list(keys)
        outs = [None] * len(xs) if outs is None else list(outs)
        if not len(keys) == len(outs) == len(xs):
            raise AgentError(f"{self.cfg.who}: {len(xs)} tensors, {len(keys)} keys and "
                             f"{len(outs)} outs")
        local = [self._local(x) for x in xs]  # (each checked before any round)
        pipe = Listed(list(zip(local, keys)))
        got = []
        try:
            for i, (x, key, out) in enumerate(zip(local, keys, outs)):
                pipe.start(i)
                got.append(self.allreduce_detailed(x, key, out, pipeline=pipe))
        except AgentError:
            # (every worker's list stops here alike, or the agent is broken: a round 1 that
            # went ahead is dropped with it)
            self._served = None
            raise
        return got

    def allreduce_detailed(self, x, key=None, out: np.ndarray | None = None,
                           pipeline: Pipeline | None = None) -> Result:
        """``allreduce`` with the exact integers behind the sum (``Result``), in five steps:
        negotiate (round 1: scale, non-finite flag, block words, the index), choose (the
        value mode, from the union), the split round (blocks that need per-element scales),
        the value rounds (rescaled on the switch's overflow flag), and decode. ``key``
        names the tensor across calls (the index and mode choices remember it).

        ``x``: a float array, or a local tensor (``local.HostTensor``, or
        ``distributed.device.DeviceTensor``: the per-element work on a GPU, ``Result.out``
        there too). ``out``: a host array for the sum (as many elements as ``x``, its dtype,
        contiguous), ``Result.out`` then; it may be ``x`` itself. Nothing is written there
        before the last round is in: an error leaves it as it was. Decoding into memory
        already in use saves a fresh array's first touch (half of a 10M-element decode's 9
        ms at 1%) and the caller's copy.

        ``pipeline``: the tensors that follow (``pipeline.Pipeline``); the next one's round 1
        rides with this one's next round where every worker has its next tensor ready, and
        the caller then all-reduces the tensor it took next (``allreduce_many`` does it
        for a list)."""
        cfg = self.cfg
        served, self._served = self._served, None
        if served is not None and served.x is not x:
            self.transport.broken = "pipeline"
            raise AgentError(f"{cfg.who}: the tensor after a pipelined one must be the one "
                             "its pipeline handed over (its round 1 went with the one "
                             "before): the workers' tensors part ways here")
        local = served.local if served is not None else self._local(x)
        n, dtype = local.n, local.dtype
        if out is not None:
            if not isinstance(local, HostTensor):
                raise AgentError(f"{cfg.who}: out is for a host tensor's sum; a device "
                                 "tensor's sum is on its device")
            try:
                out = codec.check_out(out, n, dtype)
            except codec.CodecError as err:
                raise AgentError(f"{cfg.who}: {err}") from None
        before, self._lent = self.counters.bytes_sent, 0
        if served is not None:
            neg = self._negotiate(local, key, served.proposal, served.first)
            before -= served.wire_bytes
            # (its round 1 said whether the one after it was ready: in that pipeline)
            pipeline = pipeline if pipeline is not None else served.pipeline
        else:
            neg = self._negotiate(local, key, self._propose(local, key, pipeline))
        if neg.nonfinite:
            # Every worker saw the flag in round 1: no further round, on any of them.
            log.info("%s: non-finite values in the job's tensor: NaN", cfg.who)
            return Result(local.nan(dtype) if out is None else local.nan(dtype, out),
                          0, Mode(neg.mode if neg.mode != AUTO else Mode.DENSE), n, None,
                          np.zeros(0, np.int64), self.counters.bytes_sent - before,
                          dict(neg.index_rounds), index=neg.index,
                          block_shifts=np.zeros(codec.block_count(n, cfg.block), np.int64),
                          block=cfg.block, nonfinite=True)
        mode, union_words, union = self._choose(neg, key)
        # the next tensor's round 1 goes with this one's next round, if every worker said so
        self._ahead = pipeline if neg.pipelined else None
        try:
            return self._after_choice(local, neg, mode, union_words, union, out, before)
        finally:
            self._ahead = None

    def _after_choice(self, local, neg: Negotiation, mode, union_words, union, out,
                      before: int) -> Result:
        """``allreduce_detailed`` from the mode chosen on: the scales, the split round, the
        value rounds and the decode."""
        cfg, n, dtype = self.cfg, local.n, local.dtype
        assert neg.block_words is not None
        block_offsets = codec.block_offsets(neg.block_words)
        shift = codec.shift_for(max_exponent(neg.ored[:wire.EXP_WORDS]), cfg.workers,
                                cfg.headroom) + cfg.shift_bias
        scales, split_rounds = self._split_round(
            neg, local, Scales(shift, block_offsets, cfg.block))
        scales, values, rounds = self._rescaled_rounds(local, scales, mode, union_words, union)
        out = (local.decode(values, scales, mode, union_words, union, dtype) if out is None
               else local.decode(values, scales, mode, union_words, union, dtype, out))
        return Result(out, scales.shift, Mode(mode), n, union_words, values,
                      self.counters.bytes_sent - before - self._lent,
                      {**neg.index_rounds, **split_rounds, **rounds}, union, index=neg.index,
                      block_shifts=scales.blocks(), block=cfg.block,
                      _split_at=(None if scales.at is None
                                 else (scales.at, scales.at_shifts())))

    def _local(self, x):
        """``x`` as a local tensor: a float array as a ``HostTensor``; a local tensor (one
        with ``round1``) as it is."""
        if isinstance(x, np.ndarray) or not hasattr(x, "round1"):
            x = np.asarray(x)
            if not np.issubdtype(x.dtype, np.floating):
                raise AgentError(f"{self.cfg.who}: allreduce wants floats, got {x.dtype} "
                                 "(use allreduce_int for integers)")
            return HostTensor(x)
        return x

    def _propose(self, local, key, pipeline: Pipeline | None) -> Proposal:
        """This worker's round 1 for ``local``: its max exponent (or the non-finite flag),
        whether it holds the next tensor back (``pipeline``: none ready), its block words
        and split flags, and, unless the mode is dense (asked, or remembered for ``key``),
        the index of its non-zeros (the flat bitmap, or the hierarchy's top level)."""
        cfg = self.cfg
        n, B = local.n, cfg.block
        mode = codec.as_mode(cfg.mode, auto=True)
        if mode == AUTO and key is not None and self._last_mode.get(key) == Mode.DENSE:
            mode = Mode.DENSE  # last time this tensor was dense: skip the index (all agree)
        index = None if mode == Mode.DENSE else self._index(n, key)
        # round 1 carries the flat bitmap only for the flat index (the hierarchy: its levels)
        r1 = local.round1(B, cfg.split, words=index == codec.FLAT)
        cost = getattr(self.transport, "round_cost", None)  # (in-memory transports: none)
        if cost is not None:
            cost.tensor_starts()
        # A NaN or Inf: flag it in round 1 (every worker then returns NaN), no scales.
        hold = (pipeline is None or not hasattr(self.transport, "stream_fused")
                or not pipeline.ready())
        onehot = exponent_words(r1.exponent, nonfinite=not r1.finite,
                                cost=cost.word() if cost is not None else 0, hold=hold)
        levels = local.levels() if index == codec.HIER else None
        return Proposal(mode, index, r1, onehot, levels,
                        first_words(onehot, r1.blocks, r1.flags, index, r1, levels))

    def _negotiate(self, local, key, p: Proposal, first: np.ndarray | None = None
                   ) -> Negotiation:
        """Round 1 (and, with the hierarchical index, its two further OR rounds): what the
        switch ORed of every worker's proposal ``p``. ``first``: round 1's ORed words, where
        they came already (``pipeline``)."""
        B, r1 = self.cfg.block, p.mine
        blocks, flags = r1.blocks, r1.flags
        if first is None:  # (round 1's words, as proposed: built once)
            first = self.transport.stream(wire.OP_OR, p.words)
        if p.mode == Mode.DENSE:
            agg = first.view(np.uint32)
            neg = Negotiation(r1, r1.exponent, p.mode, agg, None, None, {},
                              agg[HEAD_WORDS:HEAD_WORDS + blocks.size],
                              codec.split_blocks(agg[HEAD_WORDS + blocks.size:], r1.n, B))
        else:
            agg, union_words, sent, block_agg, split = index_rounds(
                self.transport.stream, B, r1, p.onehot, blocks, flags, p.index, p.levels,
                first=first)
            neg = Negotiation(r1, r1.exponent, p.mode, agg, union_words, p.index, sent,
                              block_agg, split)
        self._round_words = neg.round_words  # what every worker read in this round 1
        return neg

    def _stream(self, op: int, words: np.ndarray) -> np.ndarray:
        """A round of the tensor after its choice (split, values, residual): with the next
        tensor's round 1 in the same window where the job pipelines (``pipeline``), which
        the next ``allreduce_detailed`` then finds done."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return self.transport.stream(op, words)
        x, key = ahead.take()
        local = self._local(x)
        p = self._propose(local, key, ahead)
        before = self.counters.bytes_sent
        fused = self.transport.stream_fused  # type: ignore[attr-defined]  # (_propose checked)
        out, first, overflow = fused(op, words, wire.OP_OR, p.words)
        share = p.words.size / max(1, p.words.size + words.size)
        lent = round((self.counters.bytes_sent - before) * share)
        self._served = Served(x, local, p, first, lent, ahead)
        self.counters.pipelined += 1
        self._lent += lent
        if overflow:
            raise SwitchOverflow()
        return out

    def _remember_union(self, key, union_words: np.ndarray, n: int, u: int) -> None:
        """What the next index choice for tensor ``key`` reads of this union: its size, and
        (only ``auto`` weighs it) the words the hierarchy saves on it."""
        if key is None:
            return
        self._last_union[key] = u
        if codec.as_index(self.cfg.index) == codec.AUTO:
            self._hier_saves[key] = codec.hier_saving(union_words, n)

    def _index(self, n: int, key) -> str:
        """The index for tensor ``key`` (``codec.choose_index``), from what every worker
        shares: the job's round cost and the tensor's last union."""
        if key is None:
            return codec.choose_index(self.cfg.index, n)
        return codec.choose_index(self.cfg.index, n, self._last_union.get(key),
                                  self._hier_saves.get(key), self._round_words)

    def _choose(self, neg: Negotiation, key) -> tuple[str, np.ndarray | None,
                                                      np.ndarray | None]:
        """The value mode (``auto``: by the byte count, from the union's size u, which is
        remembered for ``key``), and the union it works on: (mode, the union bitmap or None
        for dense, the union's positions where the sketch needs them)."""
        mode, union_words, n = neg.mode, neg.union_words, neg.mine.n
        assert union_words is not None or mode == Mode.DENSE
        if mode != Mode.DENSE:
            assert union_words is not None
            u = codec.union_size(union_words, n)
            self._remember_union(key, union_words, n, u)
            if mode == AUTO:
                mode = codec.choose_mode(n, u, self.cfg.ratio,
                                         index_words=sum(neg.index_rounds.values()))
            if mode == Mode.DENSE:
                union_words = None
        # Only the sketch needs U's positions; union mode works from the bitmap itself.
        union = (codec.union_indices(union_words, n)
                 if mode == Mode.SKETCH and union_words is not None else None)
        if key is not None:
            self._last_mode[key] = mode
        return mode, union_words, union

    def _split_round(self, neg: Negotiation, local, scales: Scales
                     ) -> tuple[Scales, dict[str, int]]:
        """The split round, when some block split: one word per element of a split block,
        its elements' own offsets (every worker has the same blocks, from the OR). Returns
        the scales with the split blocks' elements and their own offsets (their block's
        where the element is zero on every worker), and the round's words."""
        if not neg.split.size:
            return scales, {}
        n, B = neg.mine.n, self.cfg.block
        at = codec.split_positions(neg.split, n, B)
        ored = self._stream(wire.OP_OR, local.element_words(at, neg.exponent)
                            ).view(np.uint32)
        own = np.where(ored != 0, codec.block_offsets(ored), scales.offsets[at // B])
        return replace(scales, at=at, at_offsets=own), {"split": at.size}

    def _rescaled_rounds(self, local, scales: Scales, mode, union_words, union
                         ) -> tuple[Scales, np.ndarray, dict]:
        """The value rounds at the negotiated ``scales``; when the switch flags an overflow,
        again with every scale 16 times coarser (every worker sees the flag and does the
        same), up to ``max_rescales`` times. Returns the scales that went through, the exact
        sums and the words per round."""
        cfg = self.cfg
        for _attempt in range(cfg.max_rescales + 1):
            try:
                values, rounds = self._value_rounds(local, scales, mode, union_words, union)
                return scales, values, rounds
            except SwitchOverflow:
                self.counters.rescales += 1
                log.info("%s: overflow at shift %d, rescaling", cfg.who, scales.shift)
                scales = scales.coarser(4)
            except codec.CodecError as err:  # e.g. a local value out of int32 at this scale
                self.transport.broken = str(err)
                fail = AgentError(f"{cfg.who}: {err}; peers will time out on this tensor")
                fail.index = err.index  # type: ignore[attr-defined]
                raise fail from None
        raise AgentError(f"{cfg.who}: int32 overflow persists after "
                         f"{cfg.max_rescales} rescales")

    def _value_rounds(self, local, scales: Scales, mode, union_words, union):
        """The value round (and the residual): exact sums, dense or on the union (the
        switch's int32 words) or the sketch's (int64), each element at its shift. An empty
        union (every worker sees it) sends nothing."""
        stream = self._stream
        if mode == Mode.SKETCH and union_words is not None and not union.size:
            return np.zeros(0, np.int64), {}  # an empty union, on every worker
        scratch = getattr(self.transport, "scratch", None)  # (kept from round to round)
        words = local.value_words(mode, scales, union_words, union, self.seed, self.cfg.ratio,
                                  np.empty if scratch is None else scratch.empty)
        if mode == Mode.DENSE or union_words is None:
            # (the switch's int32 words, as the union's: an int64 copy was 8 bytes an element
            # at the all-reduce's peak; ``Result.ints`` widens them)
            return stream(wire.OP_ADD, words), {"dense": words.size}
        if mode == Mode.UNION:  # straight from the bitmap: U is never listed
            if not words.size:  # an empty union, on every worker: nothing to send
                return words, {}
            return stream(wire.OP_ADD, words), {str(mode): words.size}
        agg = stream(wire.OP_ADD, words)
        peeled = codec.decode_values(agg, union, mode, self.seed)
        values, left = peeled.values, peeled.unresolved
        rounds = {str(mode): words.size}
        if left.size:
            resid = stream(wire.OP_ADD, local.residual_words(union[left]))
            values = values.copy()
            values[left] = resid
            rounds["residual"] = left.size
        codec.check_int32(values, mode)
        return values, rounds
