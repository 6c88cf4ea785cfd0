"""A GGUF file on llama.cpp's own engine (ggml), through llama-cpp-python's low-level API
(docs/design.md), behind the engine's target interface
(:class:`specwise.engine.target.DecodingTarget`).

- A forward is one ``llama_decode`` over the new tokens, with logits asked for exactly the rows
  verification reads (``llama_batch.logits``) and read back in one copy.
- A generation's cache is a range of sequence ids in one context whose KV cells are shared by all
  sequences (``kv_unified``); sequence ``base`` holds the committed tokens. A chain is decoded in
  it and rolled back with ``llama_memory_seq_rm``. A draft tree (or any layout, Lookahead's
  window included) is decoded in one call with a sequence id per *sink* (a token no other token
  sees: a tree's leaves): each token carries the ids of the sinks that see it, so two tokens see
  each other exactly when they lie on one sink's path, and positions keep them causal. The layout
  is checked to be representable this way before anything is decoded. After acceptance the
  accepted path is copied into ``base`` and every branch sequence removed: sequence operations
  only, nothing decoded again.
- Gemma-3's sliding-window layers keep every cell (``swa_full``), so a rollback past the window
  still finds its keys.
- Loading llama.cpp's CPU backend for this CPU, and the choices that follow from it (weight
  repacking, the drafters' dtype): :mod:`specwise.targets.llamacpp_backend`. A generation's cache
  (its range of sequence ids): :mod:`specwise.targets.llamacpp_cache`.
- Hidden states come from llama.cpp's graph evaluation callback (:mod:`specwise.targets.llamacpp_taps`).
  ggml computes the final layer only for the rows logits were asked for, so the final hidden state
  exists for those rows only; the other rows are NaN (verification asks for every row it keeps,
  and a drafter that needs the final state at every position is refused,
  :attr:`LlamaCppTarget.final_hidden_rows_only`). Index 0, the input embeddings, is computed from
  the file's embedding table.
- What a trained drafter borrows (model config, token embedding, LM-head rows) is read from the
  GGUF file (:mod:`specwise.targets.gguf_parts`).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from specwise.engine.capacity import Capacity
from specwise.engine.kept import TargetKept
from specwise.engine.target import AttentionLayout, TargetOutput
from specwise.errors import CapacityError, ConfigError, EngineError, TargetLoadError
from specwise.targets.batching import DecodeBatcher, EngineThread, RoundTimes
from specwise.targets.chat import TextCodec
from specwise.targets.gguf_parts import GGUFParts
from specwise.targets.llamacpp_backend import drafter_dtype, lc, load_backends, loaded_cpu_variant, repack_by_default
from specwise.targets.llamacpp_cache import SEQUENCES_PER_GENERATION, LlamaCppCache
from specwise.targets.llamacpp_taps import Taps
from specwise.targets.openmp import openmp_runtimes, release_pool, set_team

#: generations one context serves at once (each with its own range of sequence ids)
GENERATIONS = 8  # x SEQUENCES_PER_GENERATION = 256, the most sequences a llama.cpp context takes
#: tokens one ``llama_decode`` takes (a longer prompt is decoded in chunks)
BATCH_TOKENS = 512
#: the shortest prompt prefix taken from another generation's cached sequence instead of decoded
MIN_REUSED = 16
#: tokens of a batch member's prompt prefilled per round (the other members step between its chunks)
PREFILL_CHUNK = 128
#: ggml's name of the final normed hidden state (the LM head's input)
FINAL_NORM = b"result_norm"
#: host memory the finished generations' caches kept for prefix reuse may take (bytes; oldest dropped first)
KEPT_BYTES = 1 << 30


@dataclass
class _Kept:
    """A finished generation's committed sequence, kept in host memory for prefix reuse: its tokens
    and its cells' keys and values as llama.cpp serializes one sequence (``llama_state_seq_get_data``)."""

    tokens: list[int]
    state: np.ndarray  # [bytes] uint8


class LlamaCppTarget(TextCodec):
    """A GGUF file run by llama.cpp (see the module docstring).

    Args:
        path: the ``.gguf`` file.
        tokenizer: its Hugging Face tokenizer (the same the torch engine uses, so both engines see
            the same token ids), for text, chat templates and the stop strings' decoding.
        name: what it was loaded by.
        n_ctx: context positions (default: the model's own, as trained).
        threads: compute threads (default: torch's, which follows ``OMP_NUM_THREADS``).
        repack: weight repacking (``None``: :func:`repack_by_default` for the CPU variant loaded).
        dtype: what :attr:`dtype` reports, the dtype drafters compute in (``None``:
            :func:`drafter_dtype`); logits are float32 whatever it is.
        prefix_reuse: a prompt that begins with tokens another generation's committed sequence
            holds (running, or finished and kept) takes their cached keys and values instead of
            decoding them (:data:`MIN_REUSED` tokens at least): a running generation's by a
            sequence copy. A finished generation's cells go to host memory (``kept_bytes`` at
            most, the oldest dropped first) and come back on a match, so the pool holds running
            generations only: a decode's attention spans every used cell of the pool, and cells
            kept there slowed the others (docs/benchmarks/serve-concurrency-report.md, "Stop 70").
            A model with sliding-window layers keeps them in the pool instead, until its range is
            needed: llama.cpp writes a sequence's state without the cells its window no longer
            sees, so a copy could not be cut back to a shorter prefix.
        kept_bytes: host memory for the finished generations' caches (:data:`KEPT_BYTES`).

    Raises:
        TargetLoadError: llama-cpp-python is missing, or llama.cpp cannot load the file.
    """

    computes_logits_from_hidden = False
    gives_hidden_states = True
    #: the final hidden state exists only at the rows logits were asked for (see the module docstring)
    final_hidden_rows_only = True
    weights = "gguf"
    engine = "llamacpp"

    def __init__(self, path: str | Path, tokenizer, name: str, *, n_ctx: int | None = None,
                 threads: int | None = None, repack: bool | None = None, dtype: torch.dtype | None = None,
                 prefix_reuse: bool = True, kept_bytes: int = KEPT_BYTES) -> None:
        load_backends()
        self._dtype = drafter_dtype() if dtype is None else dtype
        self.path, self.tokenizer, self.name = Path(path), tokenizer, name
        self.kept = TargetKept()
        self.repack = repack_by_default(variant=loaded_cpu_variant()) if repack is None else repack
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = self.repack
        self.model = lc.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self.model:
            raise TargetLoadError(f"llama.cpp could not load {self.path}.")
        vocab = lc.llama_model_get_vocab(self.model)
        self.vocab_size = int(lc.llama_vocab_n_tokens(vocab))
        self.max_context = int(min(n_ctx or 1 << 30, lc.llama_model_n_ctx_train(self.model)))
        self.threads = int(threads or torch.get_num_threads())
        self.num_layers = int(lc.llama_model_n_layer(self.model))
        self.hidden_size = int(lc.llama_model_n_embd(self.model))
        self._taps = Taps()
        self.ctx = lc.llama_init_from_model(self.model, self._context_params())
        if not self.ctx:
            raise TargetLoadError(f"llama.cpp could not make a context of {self.max_context} positions for {name}.")
        self.memory = lc.llama_get_memory(self.ctx)
        # llama.cpp's end-of-generation set (EOS, end of turn, and the tokens it ends at by name,
        # e.g. Qwen2.5's <|endoftext|>, which its chat turns can end with): the set llama-server stops at
        self.eos_token_ids = frozenset(
            {t for t in range(self.vocab_size) if lc.llama_vocab_is_eog(vocab, t)}
            | {t for t in (tokenizer.eos_token_id,) if t is not None and 0 <= t < self.vocab_size})
        self.lock = threading.Lock()  # a context decodes one batch at a time
        self._free_slots = list(range(GENERATIONS))
        # caches given back, ``(slot, None)`` for a generation's range or ``(slot, seq)`` for a side
        # cache's sequence: put there without a lock (finalizers), emptied under it (:meth:`_drain`)
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        self.prefix_reuse = prefix_reuse
        self.reused_tokens = 0  # prompt tokens taken from cached sequences instead of decoded
        self._live: dict[int, list[int]] = {}  # slot -> its committed tokens (running generations)
        self._kept: dict[int, list[int]] = {}  # free slot -> the tokens its committed sequence still holds
        # finished generations' committed sequences in host memory, oldest first (a number each)
        self._host: OrderedDict[int, _Kept] = OrderedDict()
        self._host_count = 0
        self.kept_bytes = kept_bytes
        self._keeps_in_host = int(lc.llama_model_n_swa(self.model)) == 0
        self._batch = lc.llama_batch_init(BATCH_TOKENS, 0, SEQUENCES_PER_GENERATION)
        self._engine = EngineThread(f"specwise-llamacpp-{name}")
        self._openmp = openmp_runtimes()
        self._torch_threads = torch.get_num_threads()  # a lone generation's torch team (set_team)
        self._engine_pool = False  # whether the engine thread ran rounds since it last let its pool go
        self._batcher = DecodeBatcher(self._decode_on_engine)
        # the pool's cells (the unified cache holds max_context) and ranges, reserved by the
        # generations a batch admits (the worker, generate_many)
        self.capacity = Capacity(self.max_context, GENERATIONS)
        self._finalizer = weakref.finalize(self, _free_native, self._batch, self.ctx, self.model, self._engine)

    def _context_params(self):
        params = lc.llama_context_default_params()
        params.n_ctx = self.max_context
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = GENERATIONS * SEQUENCES_PER_GENERATION
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True
        params.swa_full = True
        params.no_perf = True
        params.cb_eval = self._taps.callback
        if hasattr(params, "n_outputs_max_per_seq"):
            params.n_outputs_max_per_seq = 0  # every row of a sequence may ask for logits
        return params

    # ---------------------------------------------------------------- the interface
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype drafters beside this target compute in (the logits are float32)."""
        return self._dtype

    @property
    def final_layer(self) -> int:
        """HF ``hidden_states`` index of the final (normed) hidden state: the layer count L."""
        return self.num_layers

    @cached_property
    def _parts(self) -> GGUFParts:
        return GGUFParts(self.path)

    @property
    def text_config(self):
        """The model's Hugging Face text config (read from the GGUF file's metadata)."""
        return self._parts.text_config

    def input_embeddings(self):
        """The token embedding as a module: ``[...]`` long ids -> ``[..., H]`` float32 (read from the file)."""
        return self._parts.embeddings

    def output_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of ``token_ids [R]`` long: ``[R, H]`` float32 (read from the file)."""
        return self._parts.output_rows(token_ids)

    def _tap_names(self, hidden_layers: tuple[int, ...]) -> dict[bytes, int]:
        names = {}
        for layer in hidden_layers:
            if not 0 <= layer <= self.num_layers:
                raise ConfigError(f"{self.name} has hidden states 0..{self.num_layers}, not {layer}.")
            if layer == 0:
                continue  # the input embeddings: read from the file, not tapped
            names[FINAL_NORM if layer == self.num_layers else f"l_out-{layer - 1}".encode()] = layer
        return names

    def logits_from_final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ConfigError("the llama.cpp engine computes logits only in its forward.")

    def new_cache(self, within: LlamaCppCache | None = None) -> LlamaCppCache:
        """A cache for one generation: a free range of sequence ids, emptied. With ``within`` (a
        running generation's cache), a side cache on that generation's last branch sequence, for a
        forward between its steps (none of its tree's branches exist then); release it before the
        generation's next forward.

        Raises:
            CapacityError: every range is in use (more than :data:`GENERATIONS` generations at once).
        """
        if within is not None:
            side = within.base + SEQUENCES_PER_GENERATION - 1
            with self.lock:
                self._drain()
                lc.llama_memory_seq_rm(self.memory, side, -1, -1)
            return LlamaCppCache(self, within.slot, base=side)
        with self.lock:
            self._drain()
            if not self._free_slots:
                raise CapacityError(f"the llama.cpp target {self.name} serves at most {GENERATIONS} generations at once.")
            # a range whose tokens no one can reuse first, else the one kept longest
            slot = next((s for s in self._free_slots if s not in self._kept), self._free_slots[0])
            self._free_slots.remove(slot)
            self._kept.pop(slot, None)
            self._live[slot] = []
            base = slot * SEQUENCES_PER_GENERATION
            for seq in range(base, base + SEQUENCES_PER_GENERATION):
                lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return LlamaCppCache(self, slot)

    @property
    def free_generations(self) -> int:
        """Ranges free for a new generation now (released caches counted)."""
        with self.lock:
            self._drain()
            return len(self._free_slots)

    def _drain(self) -> None:
        """Give back the caches released since the last call (the lock held)."""
        while True:
            try:
                slot, seq = self._released.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
            else:
                self._release(slot)

    def _release(self, slot: int) -> None:
        """A generation's range back to the free list (the lock held); its committed sequence is
        kept for prefix reuse while no one needs its cells."""
        base = slot * SEQUENCES_PER_GENERATION
        tokens = self._live.pop(slot, [])
        keep = self.prefix_reuse and len(tokens) >= MIN_REUSED
        if keep and self._keeps_in_host:
            self._keep_in_host(base, tokens)
        in_pool = keep and not self._keeps_in_host
        for seq in range(base + 1 if in_pool else base, base + SEQUENCES_PER_GENERATION):
            lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        if in_pool:  # its committed sequence stays until the range is needed again
            self._kept[slot] = tokens
        self._free_slots.append(slot)

    def _keep_in_host(self, seq: int, tokens: list[int]) -> None:
        """Copy sequence ``seq``'s cells to host memory, dropping the oldest copies past
        :attr:`kept_bytes` (the lock held)."""
        # positions 0 .. len(tokens) - 1 exactly: a failed decode's undo may leave the list longer
        held = int(lc.llama_memory_seq_pos_max(self.memory, seq)) + 1
        if int(lc.llama_memory_seq_pos_min(self.memory, seq)) != 0 or min(held, len(tokens)) < MIN_REUSED:
            return
        tokens = tokens[:held]
        lc.llama_memory_seq_rm(self.memory, seq, len(tokens), -1)
        size = int(lc.llama_state_seq_get_size(self.ctx, seq))
        if not 0 < size <= self.kept_bytes:
            return
        state = np.empty(size, dtype=np.uint8)
        if lc.llama_state_seq_get_data(self.ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq) != size:
            return
        self._host_count += 1
        self._host[self._host_count] = _Kept(list(tokens), state)
        while sum(entry.state.nbytes for entry in self._host.values()) > self.kept_bytes:
            self._host.popitem(last=False)

    def _restore(self, number: int, seq: int, length: int) -> bool:
        """Host copy ``number`` into the empty sequence ``seq``, cut to its first ``length``
        positions (the lock held); ``False`` (the sequence left empty) where the pool has no room."""
        state = self._host[number].state
        self._host.move_to_end(number)  # the most recently used is dropped last
        pointer = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if lc.llama_state_seq_set_data(self.ctx, pointer, state.nbytes, seq) != state.nbytes:
            lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
            return False
        lc.llama_memory_seq_rm(self.memory, seq, length, -1)
        return True

    def _reuse_prefix(self, tokens: list[int], cache: LlamaCppCache) -> int:
        """Fill an empty cache with the longest prefix of ``tokens`` that a committed sequence
        (running or kept) holds, at most ``len(tokens) - 1`` (the last token is decoded for its
        logits): by a sequence copy from the pool (the cells are shared) or from a host copy;
        nothing is decoded. Returns its length."""
        best, source, copy = 0, None, None
        with self.lock:
            for slot, held in list(self._live.items()) + list(self._kept.items()):
                if slot == cache.slot:
                    continue
                same = _common_prefix(held, tokens, len(tokens) - 1)
                if same > best:
                    best, source = same, slot
            for number, entry in reversed(self._host.items()):  # the newest first: it wins a tie
                same = _common_prefix(entry.tokens, tokens, len(tokens) - 1)
                if same > best:
                    best, copy = same, number
            if best < MIN_REUSED:
                return 0
            if copy is None:
                lc.llama_memory_seq_cp(self.memory, source * SEQUENCES_PER_GENERATION, cache.base, 0, best)
            elif not self._restore(copy, cache.base, best):
                return 0
            self.reused_tokens += best
        return best

    def forward(self, input_ids: torch.Tensor, cache: LlamaCppCache, *, num_logits: int | None = None,
                logit_rows: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                layout: AttentionLayout | None = None) -> TargetOutput:
        """``input_ids [n]`` after the cached prefix, in one ``llama_decode`` (or chunks of
        :data:`BATCH_TOKENS` for a long causal input); logits ``[R, V]`` float32 of the rows asked for.

        ``hidden_layers`` (HF indexing, 0..L) come back ``[n, H]`` float32; the final layer's rows
        outside the logit rows are NaN (ggml does not compute them).

        Raises:
            ConfigError: a hidden layer outside 0..L, one the graph did not give (an architecture
                that names its layers otherwise), or a layout no set of sequences can express.
        """
        taps = self._tap_names(hidden_layers) if hidden_layers else {}
        tokens = input_ids.tolist()
        n = len(tokens)
        if logit_rows is not None:
            rows = [int(r) for r in logit_rows]
        else:
            rows = list(range(n - min(num_logits or n, n), n))
        if (cache.length == 0 and layout is None and not hidden_layers and self.prefix_reuse
                and n > MIN_REUSED and min(rows, default=0) >= MIN_REUSED):
            reused = self._reuse_prefix(tokens, cache)
            if reused and min(rows) >= reused:
                cache.length = reused
                cache.tokens[:] = tokens[:reused]
                out = self.forward(input_ids[reused:], cache, logit_rows=torch.tensor([r - reused for r in rows]))
                return out
            if reused:  # rows inside the copied part were asked for: decode them after all
                cache.length = reused
                cache.rollback(0)
        start = cache.length
        if layout is None:
            seqs = [[cache.base]] * n
            positions = list(range(start, start + n))
            cache._branches = None
        else:
            seqs, positions = _sequences(layout, cache.base)
            cache._branches, cache._start, cache._tree_tokens = seqs, start, tokens
        logits, hidden = self._decode(tokens, positions, seqs, rows, cache, taps)
        if 0 in hidden_layers:
            hidden[0] = self.input_embeddings()(input_ids.cpu())
        if layout is None:
            cache.tokens[start:] = tokens
        cache.length = start + n
        return TargetOutput(torch.from_numpy(logits), hidden)

    def _decode(self, tokens, positions, seqs, rows, cache, taps) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
        """One forward's decode: alone, or in the batch's next round when this thread is a member
        (:meth:`batch_member`); a member's long causal input goes in chunks of :data:`PREFILL_CHUNK`
        tokens, a round each, so the other members' streams keep flowing while it is prefilled."""
        wanted = sorted(set(rows))
        flags = [False] * len(tokens)
        for r in wanted:
            flags[r] = True
        copies: list[int] = []
        if cache._branches is not None:  # a tree: its branches see the committed tokens too
            copies = sorted({s for row in seqs for s in row} - {cache.base})
            if len(tokens) > BATCH_TOKENS:
                raise ConfigError(f"a tree of {len(tokens)} tokens exceeds one decode ({BATCH_TOKENS}).")
        member = self._batcher.is_member()
        if member:  # each member sizes its own thread's torch team (whoever runs the round)
            set_team(self._openmp, self._torch_threads if self._batcher.members < 2 else 1)
        chunk = PREFILL_CHUNK if member else BATCH_TOKENS
        logits, pieces = [], {layer: [] for layer in taps.values()}
        for begin in range(0, len(tokens), chunk):
            end = min(begin + chunk, len(tokens))
            part = _Decode(tokens[begin:end], positions[begin:end], seqs[begin:end], flags[begin:end], taps,
                           cache.base, cache.length if begin == 0 else 0, copies if begin == 0 else [])
            out, got = self._batcher.submit(part, member)
            logits.append(out)
            for layer, array in got.items():
                pieces[layer].append(array)
        out = np.concatenate(logits) if len(logits) > 1 else logits[0]
        index = {r: i for i, r in enumerate(wanted)}
        hidden = {layer: self._hidden_rows(layer, pieces[layer], len(tokens), wanted) for layer in taps.values()}
        return (out[[index[r] for r in rows]] if rows != wanted else out), hidden

    def _decode_on_engine(self, requests: list) -> None:
        """:meth:`_decode_many`, on the target's engine thread while several generations take turns
        running the rounds (:class:`specwise.targets.batching.EngineThread`: ggml's OpenMP team stays
        one), else on the calling thread: alone, a generation's thread is the only one calling, so
        there is no other team to spin, and a hop per step would only add its wake-ups. The first
        lone decode after rounds has the engine thread let its pool go first; while rounds run, each
        member's own torch operations (sampling, drafting) run on its thread alone, with no team beside
        the engine's (set in :meth:`_decode`, :mod:`specwise.targets.openmp`)."""
        if self._batcher.members < 2:
            if self._engine_pool:  # its idle OpenMP workers would slow this thread's team (openmp.py)
                self._engine_pool = False
                self._engine.call(lambda: release_pool(self._openmp))
            self._decode_many(requests)
        else:
            self._engine_pool = True
            self._engine.call(lambda: self._decode_many(requests))

    def _decode_many(self, requests: list) -> None:
        """Run the requests' decodes (each :class:`_Decode` whole), packed into as few
        ``llama_decode`` calls of at most :data:`BATCH_TOKENS` tokens as their order allows; sets each
        request's result to ``(logits [rows asked, V] float32, {layer: [rows, H] float32})``."""
        groups: list[list] = [[]]
        for request in requests:
            if groups[-1] and sum(len(r.payload.tokens) for r in groups[-1]) + len(request.payload.tokens) > BATCH_TOKENS:
                groups.append([])
            groups[-1].append(request)
        with self.lock:
            self._drain()
            for group in groups:
                try:
                    self._decode_group(group)
                except EngineError as exc:
                    if len(group) == 1:
                        group[0].error = exc
                        continue
                    # one member's fault stays its own: each runs alone, and only those that fail
                    # alone get an error (a failed decode leaves the cache as it was)
                    for request in group:
                        try:
                            self._decode_group([request])
                        except EngineError as alone:
                            request.error = alone

    def _decode_group(self, group: list) -> None:
        """One ``llama_decode`` over the group's requests (the lock held), their results split out."""
        parts = [r.payload for r in group]
        taps: dict[bytes, int] = {}
        for part in parts:
            taps.update(part.taps)
        self._taps.ask(taps)
        try:
            for part in parts:
                for seq in part.copies:
                    lc.llama_memory_seq_cp(self.memory, part.base, seq, 0, part.cached)
            self._fill([t for p in parts for t in p.tokens], [q for p in parts for q in p.positions],
                       [s for p in parts for s in p.seqs], [f for p in parts for f in p.flags])
            code = lc.llama_decode(self.ctx, self._batch)
            if code == 1 and self._kept:  # no room for the batch: drop the sequences kept for reuse
                for slot in list(self._kept):
                    lc.llama_memory_seq_rm(self.memory, slot * SEQUENCES_PER_GENERATION, -1, -1)
                self._kept.clear()
                code = lc.llama_decode(self.ctx, self._batch)
            if code != 0 or self._taps.error is not None:
                self._undo(parts)
            if self._taps.error is not None:
                raise EngineError(f"reading {self.name}'s hidden states failed: {self._taps.error}") \
                    from self._taps.error
            if code != 0:
                size = sum(len(p.tokens) for p in parts)
                where = f"{size} tokens of {len(parts)} generation(s) at position {parts[0].positions[0]}"
                if code == 1:
                    raise CapacityError(f"{self.name}'s cache of {self.max_context} cells has no room for {where}; "
                                        "retry when fewer generations run.")
                raise EngineError(f"llama.cpp's decode failed (code {code}) on {where}.")
            count = sum(sum(p.flags) for p in parts)
            out = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(count, self.vocab_size)).copy() \
                if count else np.empty((0, self.vocab_size), dtype=np.float32)
            got = {layer: np.concatenate(arrays) if arrays else np.empty((0, self.hidden_size), np.float32)
                   for layer, arrays in self._taps.got.items()}
        finally:
            self._taps.ask({})
        token_at = row_at = 0
        for request, part in zip(group, parts):
            n, m = len(part.tokens), sum(part.flags)
            mine = {layer: got[layer][row_at: row_at + m] if layer == self.num_layers
                    else got[layer][token_at: token_at + n] for layer in part.taps.values()}
            request.result = (out[row_at: row_at + m], mine)
            token_at, row_at = token_at + n, row_at + m

    def _undo(self, parts: list) -> None:
        """Drop what a failed decode may have left of its parts (an aborted graph keeps its cells):
        every sequence they wrote, from their first new position on (the lock held)."""
        for part in parts:
            if part.positions:
                start = min(part.positions)
                for seq in {s for row in part.seqs for s in row}:
                    lc.llama_memory_seq_rm(self.memory, seq, start, -1)

    @contextmanager
    def batch_member(self) -> Iterator[None]:
        """For the block, this thread's forwards run in one ``llama_decode`` with those of every
        other thread inside its own block (:class:`specwise.targets.batching.DecodeBatcher`): one
        generation per thread, each with its own cache; outside such a block a forward runs alone.
        Inside, the thread's torch operations run without a team of their own except while it is
        the batch's only member (:meth:`_decode_on_engine`)."""
        with self._batcher.member():
            set_team(self._openmp, 1)
            try:
                yield
            finally:
                set_team(self._openmp, self._torch_threads)

    @property
    def max_generations(self) -> int:
        """Generations (caches) this target serves at once."""
        return GENERATIONS

    @property
    def batch_size(self) -> int:
        """Generations running in the batch now (threads inside :meth:`batch_member`)."""
        return self._batcher.members

    @property
    def kept_tokens(self) -> int:
        """Tokens of finished generations kept for later prompts that share a prefix: in host
        memory (bounded by :attr:`kept_bytes`), or for a model with sliding-window layers in the
        pool (one committed sequence per free generation range, at most :data:`GENERATIONS`)."""
        return (sum(len(tokens) for tokens in list(self._kept.values()))
                + sum(len(entry.tokens) for entry in list(self._host.values())))

    @property
    def batch_rounds(self) -> int:
        """Batched rounds run so far (one per step of the batch's members)."""
        return self._batcher.rounds

    @property
    def batch_times(self) -> RoundTimes:
        """Where the batched rounds' time went so far: in the engine, or between rounds (the
        members' own work, which each round waits for)."""
        return self._batcher.times

    def _hidden_rows(self, layer: int, pieces: list[np.ndarray], n: int, wanted: list[int]) -> torch.Tensor:
        """One tapped layer's ``[n, H]`` from its pieces (one per decoded chunk; the final layer's
        pieces hold the logit rows only)."""
        values = torch.from_numpy(np.concatenate(pieces)) if pieces else torch.empty(0, self.hidden_size)
        expected = n if layer != self.num_layers else len(wanted)
        if values.shape != (expected, self.hidden_size):
            raise ConfigError(f"llama.cpp's graph of {self.name} gave {tuple(values.shape)} for hidden state {layer}, "
                              f"not {(expected, self.hidden_size)}: this architecture names its layers otherwise.")
        if layer != self.num_layers:
            return values
        full = torch.full((n, self.hidden_size), float("nan"))
        full[wanted] = values
        return full

    def _fill(self, tokens, positions, seqs, flags) -> None:
        batch = self._batch
        for i, (token, position, ids, flag) in enumerate(zip(tokens, positions, seqs, flags)):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(ids)
            for j, seq in enumerate(ids):
                batch.seq_id[i][j] = seq
            batch.logits[i] = flag
        batch.n_tokens = len(tokens)


@dataclass(frozen=True)
class _Decode:
    """One generation's share of a decode: its tokens with their positions, sequence ids and logit
    flags, the tensors it taps, and the sequences (``copies``) to fill from its committed sequence
    ``base`` (its first ``cached`` positions) before the decode (a tree's branches)."""

    tokens: list[int]
    positions: list[int]
    seqs: list[list[int]]
    flags: list[bool]
    taps: dict[bytes, int]
    base: int
    cached: int
    copies: list[int]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _free_native(batch, ctx, model, engine) -> None:
    engine.close()
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


def _sequences(layout: AttentionLayout, base: int) -> tuple[list[list[int]], list[int]]:
    """Sequence ids that express ``layout`` in llama.cpp's attention (a token sees a cell iff they
    share a sequence id and the cell's position is not after its own): one id per sink, each token
    tagged with the sinks that see it.

    Returns:
        ``(per token its sequence ids, positions)``.

    Raises:
        ConfigError: the layout cannot be expressed so (it sees tokens its readers do not), or it
            needs more sequences than a generation has.
    """
    visible = layout.visible.bool().cpu()
    positions = layout.positions.tolist()
    n = visible.shape[0]
    seen_by_others = (visible & ~torch.eye(n, dtype=torch.bool)).any(dim=0)
    sinks = (~seen_by_others).nonzero().flatten().tolist()
    if len(sinks) >= SEQUENCES_PER_GENERATION:
        raise ConfigError(f"a layout with {len(sinks)} branches exceeds the {SEQUENCES_PER_GENERATION - 1} sequences "
                          "a generation has on the llama.cpp engine.")
    member = visible[sinks].T  # shape: [n, S]; member[j, k]: sink k sees token j (j carries k's sequence)
    # what llama.cpp will compute from these ids and positions must be the layout itself
    shares = (member.to(torch.int32) @ member.T.to(torch.int32)) > 0  # shape: [n, n]
    pos = layout.positions.cpu()
    implied = shares & (pos[None, :] <= pos[:, None])
    if not bool(member.any(dim=1).all()) or not torch.equal(implied, visible):
        raise ConfigError("this draft layout cannot be expressed as llama.cpp sequences.")
    seqs = [[base + 1 + k for k in row.nonzero().flatten().tolist()] for row in member]
    return seqs, positions
