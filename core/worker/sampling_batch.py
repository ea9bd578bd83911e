"""Sampling state of the persistent batch: per-row parameters kept across steps.

Scalar parameters live in numpy arrays indexed by batch row, so a step's
``SamplingMetadata`` is a handful of fancy-indexing gathers over the rows
that sample, not a rebuild from Python objects. State of vocabulary width
lives on the device in ``SlotTable`` rows that only the requests using it
get; a row refers to its slot, so swapping rows never copies a
vocabulary-sized row:

- penalties, folded (``core.worker.sampler.Penalties``): factor,
  correction and offset rows, plus a row marking the generated tokens. Each
  sampled token updates them by a delta (four cells), so a step reads three
  rows per request, whatever the history's length;
- the additive bias row of logit_bias / allowed_token_ids / single-token
  bad words, fixed for the request's life.

Counters of the rows using each optional feature let a step skip every
gather for features nobody in the batch uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from core.protocol import SamplingParams
from core.worker.sampler import NO_TOP_K, Penalties, SamplingMetadata, to_device

_GREEDY_EPS = 1e-5
# Optional features a row may use; each has a counter of the rows using it.
_FEATURES = ("seeded", "min_p", "penalties", "bias", "bad_words", "min_tokens", "logprobs", "prompt_logprobs")


class SlotTable:
    """Named [slots, width] tensors on the device, a slot per request that needs one.

    Grown by doubling on demand, so memory follows the most requests that
    used the feature at once, not ``max_num_seqs``.
    """

    def __init__(self, device: torch.device, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.device = device
        self.tensors = {
            name: torch.zeros((0, *shape), dtype=dt, device=device) for name, (shape, dt) in shapes.items()
        }
        self._flat_numpy: dict[str, np.ndarray] = {}
        self.free: list[int] = []

    def acquire(self) -> int:
        """A zeroed slot."""
        if not self.free:
            capacity = next(iter(self.tensors.values())).shape[0]
            grown = max(4, 2 * capacity)
            for name, old in self.tensors.items():
                new = torch.zeros((grown, *old.shape[1:]), dtype=old.dtype, device=self.device)
                new[:capacity] = old
                self.tensors[name] = new
            self._flat_numpy.clear()
            self.free.extend(range(grown - 1, capacity - 1, -1))
        slot = self.free.pop()
        for tensor in self.tensors.values():
            tensor[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def flat_numpy(self, name: str) -> np.ndarray:
        """A CPU table as a flat numpy view of the same memory (cached until it grows)."""
        view = self._flat_numpy.get(name)
        if view is None:
            view = self._flat_numpy[name] = self.tensors[name].view(-1).numpy()
        return view


class SamplingBatch:
    """Per-row sampling parameters and history of the persistent batch (see module doc)."""

    def __init__(
        self, max_num_reqs: int, vocab_size: int, device: torch.device, processed_logprobs: bool = False
    ) -> None:
        n = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.processed_logprobs = processed_logprobs
        self.generators: list[torch.Generator | None] = [None] * n
        self.temperature = np.ones(n, np.float32)  # 1.0 on greedy rows
        self.greedy = np.zeros(n, np.bool_)
        self.top_k = np.full(n, NO_TOP_K, np.int64)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        # What a sampled token writes into its slot: factor r, correction 1/r - r, presence,
        # frequency + presence.
        self.penalty_params = np.zeros((n, 4), np.float32)
        self.num_logprobs = np.full(n, -1, np.int64)  # alternatives per sampled token; -1: none
        # Alternatives per prompt token while the prompt's logprobs are still owed; -1 otherwise.
        self.prompt_logprobs = np.full(n, -1, np.int64)
        self.num_prompt_tokens = np.zeros(n, np.int64)
        self.min_tokens = np.zeros(n, np.int64)
        self.min_tokens_stops: list[list[int]] = [[] for _ in range(n)]
        self.bad_words: list[list[list[int]]] = [[] for _ in range(n)]  # those of two tokens or more
        self.penalty_slot = np.full(n, -1, np.int64)
        self.bias_slot = np.full(n, -1, np.int64)
        self.features: list[tuple[str, ...]] = [() for _ in range(n)]
        self.num_rows_with = dict.fromkeys(_FEATURES, 0)
        v = vocab_size
        # A penalised request's planes (factor, correction, offset: read every step),
        # and its seen row (1 for generated tokens: read only to update the planes).
        self.penalty_table = SlotTable(
            device, {"planes": ((3, v), torch.float32), "seen": ((v,), torch.float32)}
        )
        self.bias_table = SlotTable(device, {"bias": ((v,), torch.float32)})

    # ------------------------------------------------------------ rows

    def add(
        self,
        row: int,
        params: SamplingParams,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        eos_token_id: int | None,
        generator: torch.Generator | None,
        prompt_is_embeds: bool = False,
    ) -> None:
        """Fill ``row`` for a request whose known tokens are ``token_ids`` (prompt first)."""
        self.generators[row] = generator
        greedy = params.greedy
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else NO_TOP_K
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        r = params.repetition_penalty
        presence = params.presence_penalty
        self.penalty_params[row] = (r, 1.0 / r - r, presence, params.frequency_penalty + presence)
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        owed = params.prompt_logprobs is not None and len(token_ids) == num_prompt_tokens
        self.prompt_logprobs[row] = params.prompt_logprobs if owed else -1
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.min_tokens[row] = params.min_tokens
        stops = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stops.append(eos_token_id)
        self.min_tokens_stops[row] = stops
        single = [w[0] for w in params.bad_words_token_ids if len(w) == 1]
        self.bad_words[row] = [w for w in params.bad_words_token_ids if len(w) > 1]
        features = []
        if generator is not None:
            features.append("seeded")
        if params.min_p > 0:
            features.append("min_p")
        if params.has_penalties:
            features.append("penalties")
            self.penalty_slot[row] = self._fill_penalty_slot(params, token_ids, num_prompt_tokens, prompt_is_embeds)
        if params.logit_bias or params.allowed_token_ids is not None or single:
            features.append("bias")
            self.bias_slot[row] = self._fill_bias_slot(params, single)
        if self.bad_words[row]:
            features.append("bad_words")
        if params.min_tokens > 0 and stops:
            features.append("min_tokens")
        if params.logprobs is not None:
            features.append("logprobs")
        if owed:
            features.append("prompt_logprobs")
        self.features[row] = tuple(features)
        for name in features:
            self.num_rows_with[name] += 1

    def _fill_penalty_slot(
        self, params: SamplingParams, token_ids: Sequence[int], num_prompt: int, prompt_is_embeds: bool
    ) -> int:
        """A slot folded from the whole history (a new request, or one resumed after preemption)."""
        table = self.penalty_table
        slot = table.acquire()
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self.device)
        output = ids[num_prompt:]
        # Placeholder ids stand for prompt embeddings: no prompt tokens to penalise.
        repeated = output if prompt_is_embeds else ids
        counts = torch.bincount(output, minlength=self.vocab_size).float()
        factor, correction, offset = table["planes"][slot]
        seen = table["seen"][slot]
        r = params.repetition_penalty
        factor.fill_(1.0)
        factor[repeated] = r
        correction.copy_(1.0 / factor - factor)
        seen.copy_(counts > 0)
        offset.copy_(-(params.frequency_penalty * counts + params.presence_penalty * seen))
        return slot

    def _fill_bias_slot(self, params: SamplingParams, banned: list[int]) -> int:
        table = self.bias_table
        slot = table.acquire()
        bias = table["bias"][slot]
        if params.allowed_token_ids is not None:
            bias.fill_(float("-inf"))
            bias[torch.as_tensor(params.allowed_token_ids, device=self.device)] = 0.0
        if banned:
            bias[torch.as_tensor(banned, device=self.device)] = float("-inf")
        if params.logit_bias:
            ids = torch.as_tensor(list(params.logit_bias), device=self.device)
            values = torch.as_tensor(list(params.logit_bias.values()), dtype=torch.float32, device=self.device)
            bias.index_add_(0, ids, values)
        return slot

    def remove(self, row: int) -> None:
        """Forget ``row``'s request (its slots go back to their tables)."""
        for name in self.features[row]:
            self.num_rows_with[name] -= 1
        self.features[row] = ()
        self.generators[row] = None
        if self.penalty_slot[row] >= 0:
            self.penalty_table.release(int(self.penalty_slot[row]))
            self.penalty_slot[row] = -1
        if self.bias_slot[row] >= 0:
            self.bias_table.release(int(self.bias_slot[row]))
            self.bias_slot[row] = -1

    def move(self, src: int, dst: int) -> None:
        """Row ``src`` becomes row ``dst`` (which must have been removed); ``src`` is left empty."""
        for array in (
            self.temperature, self.greedy, self.top_k, self.top_p, self.min_p, self.penalty_params,
            self.num_logprobs, self.prompt_logprobs, self.num_prompt_tokens, self.min_tokens,
            self.penalty_slot, self.bias_slot,
        ):
            array[dst] = array[src]
        for lst in (self.generators, self.min_tokens_stops, self.bad_words, self.features):
            lst[dst] = lst[src]
        self.generators[src] = None
        self.features[src] = ()
        self.penalty_slot[src] = self.bias_slot[src] = -1

    def prompt_logprobs_delivered(self, row: int) -> None:
        if self.prompt_logprobs[row] >= 0:
            self.prompt_logprobs[row] = -1
            self.features[row] = tuple(f for f in self.features[row] if f != "prompt_logprobs")
            self.num_rows_with["prompt_logprobs"] -= 1

    def needs_host_tokens(self, row: int) -> bool:
        """Whether sampling this row reads its generated ids on the host (multi-token bad words)."""
        return bool(self.bad_words[row])

    # ------------------------------------------------------------ steps

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the device (no copy on a CPU)."""
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else to_device(tensor, self.device)

    def record_sampled(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """Fold the tokens just sampled for ``rows`` (in sampling order) into their
        penalties: four cells per token (on a GPU, without waiting for the ids)."""
        if not self.num_rows_with["penalties"]:
            return
        slots = self.penalty_slot[rows]
        picked = np.flatnonzero(slots >= 0)
        if not picked.size:
            return
        table = self.penalty_table
        p = self.penalty_params[rows[picked]]
        slots = slots[picked]
        if self.device.type == "cpu":  # numpy over the same memory: cheaper small operations
            token = token_ids.numpy()[picked]
            _fold_tokens(table.flat_numpy("planes"), table.flat_numpy("seen"), slots, token, self.vocab_size, p)
        else:
            token = token_ids if picked.size == len(rows) else token_ids[self._tensor(picked)]
            planes, seen = table["planes"].view(-1), table["seen"].view(-1)
            _fold_tokens(planes, seen, self._tensor(slots), token, self.vocab_size, self._tensor(p))

    def metadata(
        self, rows: np.ndarray, num_tokens: np.ndarray, token_ids: np.ndarray, drafts_before: np.ndarray | None = None
    ) -> SamplingMetadata:
        """This step's metadata for the batch ``rows`` that sample, in sampling order.

        ``num_tokens`` and ``token_ids`` are the persistent batch's (for
        min_tokens and multi-token bad words). A request verifying drafts
        (speculative decoding) has its row repeated, once per logits row, and
        ``drafts_before`` says how many of its drafts (written in ``token_ids``
        after its known tokens) each of them follows: the history that row's
        penalties, min_tokens and bad words see.
        """
        greedy = self.greedy[rows]
        top_k = self.top_k[rows]
        top_p = self.top_p[rows]
        counts = self.num_rows_with
        md = SamplingMetadata(
            temperature=self._tensor(self.temperature[rows]),
            top_k=self._tensor(top_k),
            top_p=self._tensor(top_p),
            greedy=self._tensor(greedy),
            generators=[self.generators[r] for r in rows] if counts["seeded"] else [None] * len(rows),
            all_greedy=bool(greedy.all()),
            no_top_k=bool((top_k == NO_TOP_K).all()),
            no_top_p=bool((top_p >= 1.0).all()),
            processed_logprobs=self.processed_logprobs,
        )
        if counts["min_p"]:
            min_p = self.min_p[rows]
            if min_p.any():
                md.min_p = self._tensor(min_p)
        if counts["bias"]:
            slots = self.bias_slot[rows]
            picked = np.flatnonzero(slots >= 0)
            if picked.size:
                md.bias_rows = self._tensor(picked)
                md.bias = self.bias_table["bias"][self._tensor(slots[picked])]
        ends = num_tokens[rows]
        if drafts_before is not None:
            ends = ends + drafts_before
        if counts["penalties"]:
            md.penalties = self._penalties(rows)
            if md.penalties is not None and drafts_before is not None and drafts_before.any():
                self._fold_drafts(md.penalties, rows, ends, drafts_before, token_ids)
        if counts["min_tokens"] or counts["bad_words"]:
            md.banned = self._banned(rows, ends, token_ids)
        if counts["logprobs"]:
            k = self.num_logprobs[rows]
            picked = np.flatnonzero(k >= 0)
            if picked.size:
                md.logprob_rows = self._tensor(picked)
                md.num_logprobs = int(k[picked].max())
        return md

    def _penalties(self, rows: np.ndarray) -> Penalties | None:
        slots = self.penalty_slot[rows]
        picked = np.flatnonzero(slots >= 0)
        if not picked.size:
            return None
        planes = self.penalty_table["planes"].index_select(0, self._tensor(slots[picked]))
        every_row = picked.size == len(rows)
        return Penalties(
            rows=None if every_row else self._tensor(picked),
            factor=planes[:, 0],
            correction=planes[:, 1],
            offset=planes[:, 2],
        )

    def _fold_drafts(
        self, penalties: Penalties, rows: np.ndarray, ends: np.ndarray, drafts_before: np.ndarray,
        token_ids: np.ndarray,
    ) -> None:
        """Fold into each logits row's own copy of its planes the drafts it follows: the
        row after draft j has drafts 0..j folded in, as if they had been sampled."""
        picked = np.arange(len(rows)) if penalties.rows is None else penalties.rows.cpu().numpy()
        slots = self.penalty_slot[rows[picked]]
        seen = self.penalty_table["seen"].index_select(0, self._tensor(slots))
        planes = torch.stack((penalties.factor, penalties.correction, penalties.offset), 1)
        p = self.penalty_params[rows[picked]]
        before = drafts_before[picked]
        local = np.arange(picked.size)
        for j in range(1, int(before.max()) + 1):
            later = np.flatnonzero(before >= j)  # rows that follow draft j - 1
            draft = token_ids[rows[picked[later]], ends[picked[later]] - before[later] + j - 1]
            _fold_tokens(planes.view(-1), seen.view(-1), self._tensor(local[later]), self._tensor(draft),
                         self.vocab_size, self._tensor(np.ascontiguousarray(p[later])))
        penalties.factor, penalties.correction, penalties.offset = planes.unbind(1)

    def _banned(
        self, rows: np.ndarray, ends: np.ndarray, token_ids: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits row, token) cells to set to -inf: stop tokens of rows still short
        of min_tokens, and the last token of a bad word whose other tokens were just generated
        (``ends[i]``: how many tokens row i's history holds)."""
        cells_rows: list[int] = []
        cells_ids: list[int] = []
        for i, row in enumerate(rows.tolist()):
            if "min_tokens" not in self.features[row] and "bad_words" not in self.features[row]:
                continue
            start, end = int(self.num_prompt_tokens[row]), int(ends[i])
            if end - start < self.min_tokens[row]:
                stops = self.min_tokens_stops[row]
                cells_rows += [i] * len(stops)
                cells_ids += stops
            for word in self.bad_words[row]:
                prefix = len(word) - 1
                if end - start >= prefix and token_ids[row, end - prefix : end].tolist() == word[:-1]:
                    cells_rows.append(i)
                    cells_ids.append(word[-1])
        if not cells_rows:
            return None
        return (
            self._tensor(np.array(cells_rows, np.int64)),
            self._tensor(np.array(cells_ids, np.int64)),
        )


def _fold_tokens(planes, seen, slots, tokens, vocab_size: int, p) -> None:
    """Fold one sampled token per slot into its planes (numpy arrays or torch tensors alike).

    ``planes`` and ``seen`` are the flat tables, ``p`` [M, 4] the rows'
    (factor, correction, presence, frequency + presence). Presence is charged
    once: the seen row gives it back to tokens already generated.
    """
    xp = np if isinstance(planes, np.ndarray) else torch
    first = slots * (3 * vocab_size) + tokens  # the token's cell in its factor plane
    seen_cells = slots * vocab_size + tokens
    offset = planes[first + 2 * vocab_size] + p[:, 2] * seen[seen_cells] - p[:, 3]
    planes[xp.stack((first, first + vocab_size, first + 2 * vocab_size), 1)] = xp.stack((p[:, 0], p[:, 1], offset), 1)
    seen[seen_cells] = 1.0


def sampling_metadata(
    params: Sequence[SamplingParams],
    vocab_size: int,
    generators: Sequence[torch.Generator | None] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
    eos_token_id: int | None = None,
    processed_logprobs: bool = False,
    device: torch.device = torch.device("cpu"),
) -> SamplingMetadata:
    """Metadata for rows given directly (tests, the profiling run), on ``device``: row i has
    ``params[i]``, ``generators[i]`` and known tokens ``token_ids[i]``, of which the
    first ``num_prompt_tokens[i]`` are the prompt (default: no history)."""
    n = len(params)
    history = [list(t) for t in token_ids] if token_ids is not None else [[] for _ in range(n)]
    prompts = list(num_prompt_tokens) if num_prompt_tokens is not None else [len(t) for t in history]
    gens = list(generators) if generators is not None else [None] * n
    batch = SamplingBatch(n, vocab_size, device, processed_logprobs)
    width = max((len(t) for t in history), default=0) or 1
    all_ids = np.zeros((n, width), np.int64)
    for row, (p, ids, num_prompt, gen) in enumerate(zip(params, history, prompts, gens)):
        batch.add(row, p, ids, num_prompt, eos_token_id, gen)
        all_ids[row, : len(ids)] = ids
    lengths = np.array([len(t) for t in history], np.int64)
    return batch.metadata(np.arange(n), lengths, all_ids)
