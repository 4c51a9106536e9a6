"""What ds4d remembers of each agent session: its last turns, to reuse them exactly and to explain misses.

An agent's next request repeats its previous prompt and the reply it got,
rendered as text again.  Tokenising that text afresh need not give back the
token ids the model generated: a sampled sequence of tokens is not always the
one the tokenizer would choose for the same text, and the reply's last token
may merge with the markup after it.  The prefix cache matches token ids, so it
would lose everything after the first difference, and a model with
per-sequence state (DeepSeek-V4) everything after the end of the previous
prompt.

So for each session (``x-session-id`` header, else ``x-session-affinity``,
else one per cache salt; sessions of different salts never meet) ds4d keeps
its last few turns as text and token ids: the rendered prompt followed by the
generated text, and the prompt ids followed by the generated ids.  A new
prompt whose text begins with a remembered prompt plus the first ``k``
generated tokens' text is tokenised as those ids followed by the tokenisation
of the rest.  The ids decode to exactly the same text (checked when the turn is
remembered), so the model reads the same prompt, split into tokens the way it
produced them.

The same memory explains misses: when a request reuses less than its
session's previous prompt and output (less one block of slack for models that
reuse whole blocks), a record says where the new prompt diverged (message
index and role, token offset, a short excerpt of both sides) or, when it did
not, what the prefix cache said.  Records are logged and the latest are kept
for ``/v1/ds4d/stats``.

With a disk cache tier, a graceful shutdown writes each session's latest turn
next to the tier's blocks (``sessions.json``; tenants as digests of their cache
salt, never the API key) and the next start reads it back, so a restarted
daemon still resumes an agent's session at the end of its last reply.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds4d.cache.tiers import replace_file
from ds4d.contracts import Tokenizer

log = logging.getLogger("ds4d.sessions")

SESSION_HEADERS = ("x-session-id", "x-session-affinity")
EXCERPT_TOKENS = 12
EXCERPT_CHARS = 80
FILE_FORMAT = "ds4d-sessions"
FILE_VERSION = 1


@dataclass(frozen=True)
class Turn:
    """One finished request of a session."""

    request_id: str
    messages: tuple[tuple[str, str], ...]
    """(role, digest) per request message, to name the first message that changed."""
    prompt_text: str
    prompt_ids: array
    output_text: str
    output_ids: array

    @property
    def fed_tokens(self) -> int:
        """Tokens whose KV the model computed: the prompt and every generated token but the last."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)


@dataclass(frozen=True)
class Tokenized:
    token_ids: tuple[int, ...]
    reused_tokens: int = 0
    """Leading tokens taken from a remembered turn instead of the tokenizer (0: plain tokenisation)."""


def message_digests(messages: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, str], ...]:
    return tuple((str(m.get("role", "")),
                  hashlib.sha256(json.dumps(m, sort_keys=True, default=str).encode()).hexdigest()[:16])
                 for m in messages)


class SessionMemory:
    def __init__(self, tokenizer: Tokenizer, *, block_size: int, max_sessions: int = 256,
                 turns_per_session: int = 4, recent_misses: int = 32) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_sessions = max_sessions
        self.turns_per_session = turns_per_session
        self._sessions: OrderedDict[tuple[str, str], deque[Turn]] = OrderedDict()
        self.misses: deque[dict] = deque(maxlen=recent_misses)
        self.misses_total = 0
        self.continued_total = 0
        self.continued_tokens_total = 0
        boundary = getattr(tokenizer, "boundary_tokens", None)
        self._boundaries: tuple[str, ...] = tuple(boundary()) if boundary is not None else ()

    @staticmethod
    def key(headers: Mapping[str, str], salt: str) -> tuple[str, str]:
        """(digest of the cache salt, session id): the salt holds the API key, which is never kept."""
        tenant = hashlib.sha256(salt.encode()).hexdigest()[:32] if salt else ""
        for name in SESSION_HEADERS:
            if headers.get(name):
                return tenant, headers[name][:128]
        return tenant, ""

    def last(self, key: tuple[str, str]) -> Turn | None:
        turns = self._sessions.get(key)
        return turns[0] if turns else None

    def closest(self, key: tuple[str, str], prompt_ids: Sequence[int]) -> Turn | None:
        """The remembered turn this prompt continues furthest (the latest on a tie): the one a miss is
        measured against, so a side request of the same session (e.g. a title) is not taken for it."""
        best, best_len = None, -1
        prompt_ids = list(prompt_ids)  # once, not per turn
        for turn in self._sessions.get(key, ()):  # latest first
            common = _common_prefix([*turn.prompt_ids, *turn.output_ids], prompt_ids)
            if common > best_len:
                best, best_len = turn, common
        return best

    # ------------------------------------------------------------------ tokenisation

    def prefix_finder(self, key: tuple[str, str]) -> Callable[[str], tuple[int, list[int]] | None]:
        """A ``KnownPrefix`` over the session's remembered turns as they are now (safe to call from
        another thread): for a text that continues a turn's prompt and generated text up to where
        the tokenizer splits anyway (an added token such as the end-of-turn marker, or the end of
        the text), that turn's ids, so only the rest of the text is tokenised.  Elsewhere None, and
        :meth:`tokenize` decides from the whole text's tokenisation."""
        turns = tuple(self._sessions.get(key, ()))
        boundaries = self._boundaries
        if not turns or not boundaries:
            return lambda text: None

        def find(text: str) -> tuple[int, list[int]] | None:
            found = self._continued(turns, text)
            if found is None or (found[0] < len(text) and not text.startswith(boundaries, found[0])):
                return None
            return found

        return find

    def note_continued(self, tokens: int) -> None:
        """A prompt whose first ``tokens`` ids came from a remembered turn (:meth:`prefix_finder`)."""
        self.continued_total += 1
        self.continued_tokens_total += tokens

    def _continued(self, turns, text: str) -> tuple[int, list[int]] | None:
        """(characters, ids) of the part of ``text`` that the turn it continues furthest covers: that
        turn's prompt and as many of its generated tokens as ``text`` repeats."""
        best: tuple[Turn, int] | None = None
        for turn in turns:
            if not text.startswith(turn.prompt_text):
                continue
            k = self._generated_prefix(turn, text)
            if best is None or len(turn.prompt_ids) + k > len(best[0].prompt_ids) + best[1]:
                best = (turn, k)
        if best is None:
            return None
        turn, k = best
        return len(turn.prompt_text) + len(self._decode(turn.output_ids[:k])), [*turn.prompt_ids, *turn.output_ids[:k]]

    def tokenize(self, key: tuple[str, str], text: str, plain_ids: Sequence[int]) -> Tokenized:
        """``text`` as token ids, reusing a remembered turn's ids for the part of it that turn covers."""
        found = self._continued(self._sessions.get(key, ()), text)
        if found is None:
            return Tokenized(tuple(plain_ids))
        covered, head = found
        if list(plain_ids[:len(head)]) == head:
            return Tokenized(tuple(plain_ids))  # the tokenizer agrees: nothing to substitute
        rest = self.tokenizer.encode(text[covered:], add_special_tokens=False) if covered < len(text) else []
        self.note_continued(len(head))
        return Tokenized(tuple(head + list(rest)), len(head))

    def _generated_prefix(self, turn: Turn, text: str) -> int:
        """The most generated tokens of ``turn`` whose text continues its prompt text in ``text``."""
        start = len(turn.prompt_text)
        if text.startswith(turn.output_text, start):
            return len(turn.output_ids)
        low, high = 0, len(turn.output_ids) - 1  # low always fits
        while low < high:
            mid = (low + high + 1) // 2
            if text.startswith(self._decode(turn.output_ids[:mid]), start):
                low = mid
            else:
                high = mid - 1
        return low

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False) if len(ids) else ""

    # ------------------------------------------------------------------ remembering and explaining

    def remember(self, key: tuple[str, str], request_id: str, messages: Sequence[Mapping[str, Any]],
                 prompt_text: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 known: tuple[int, int] = (0, 0)) -> None:
        """Keep the turn if its ids decode to its text.  ``known``: (ids, characters) at the start of
        the prompt that came from a remembered turn (:meth:`prefix_finder`), checked then, ending
        at an added token: only the ids after them are decoded again."""
        output_text = self._decode(output_ids)
        ids, chars = known
        if self._decode([*prompt_ids[ids:], *output_ids]) != prompt_text[chars:] + output_text:
            log.debug("%s: token ids do not decode to the prompt text; turn not remembered", request_id)
            return
        turn = Turn(request_id, message_digests(messages), prompt_text, array("l", prompt_ids), output_text,
                    array("l", output_ids))
        turns = self._sessions.pop(key, None) or deque(maxlen=self.turns_per_session)
        turns.appendleft(turn)
        self._sessions[key] = turns
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def explain(self, key: tuple[str, str], previous: Turn | None, *, request_id: str,
                messages: Sequence[Mapping[str, Any]], prompt_ids: Sequence[int], cached_tokens: int,
                cache_note: str, exact: bool) -> dict | None:
        """A miss record when this request reused less than ``previous`` (its session's last turn) fed.

        ``exact``: the model reuses up to any token (state checkpoints) rather than whole blocks."""
        if previous is None:
            return None
        fed = previous.fed_tokens
        slack = 0 if exact else self.block_size - 1
        if cached_tokens + slack >= fed:
            return None
        old = [*previous.prompt_ids, *previous.output_ids]
        offset = _common_prefix(old, prompt_ids)
        record: dict[str, Any] = {
            "session": key[1] or "(no session id)", "request_id": request_id, "previous_request_id":
            previous.request_id, "previous_tokens": fed, "reused_tokens": cached_tokens,
        }
        if offset >= fed:
            record["diverged_at_token"] = None
            record["reason"] = cache_note or "the prompt repeats the previous turn; the cache no longer held it"
        else:
            index, role = _first_changed_message(previous.messages, message_digests(messages))
            record.update({
                "diverged_at_token": offset, "message_index": index, "role": role,
                "previous_excerpt": self._excerpt(old[offset:]),
                "new_excerpt": self._excerpt(prompt_ids[offset:]),
                "reason": f"the prompt differs from the previous turn at token {offset} "
                          f"(message {index}, {role})",
            })
        self.misses.append(record)
        self.misses_total += 1
        log.warning("session %s: %s reused %d of the %d tokens its previous turn left: %s%s",
                    record["session"], request_id, cached_tokens, fed, record["reason"],
                    f"; was {record['previous_excerpt']!r}, now {record['new_excerpt']!r}"
                    if record["diverged_at_token"] is not None else "")
        return record

    def _excerpt(self, ids: Sequence[int]) -> str:
        return self._decode(ids[:EXCERPT_TOKENS])[:EXCERPT_CHARS]

    # ------------------------------------------------------------------ persistence

    def save(self, path: Path) -> int:
        """Write each session's latest turn to ``path`` (temporary file, then rename); sessions written."""
        sessions = []
        for (tenant, session), turns in self._sessions.items():
            t = turns[0]
            sessions.append({"tenant": tenant, "session": session, "request_id": t.request_id,
                             "messages": [list(m) for m in t.messages], "prompt_text": t.prompt_text,
                             "prompt_ids": t.prompt_ids.tolist(), "output_text": t.output_text,
                             "output_ids": t.output_ids.tolist()})
        text = json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION, "sessions": sessions})
        if not replace_file(path, lambda tmp: tmp.write_text(text), "session memory", log):
            return 0
        return len(sessions)

    def load(self, path: Path) -> int:
        """Read what :meth:`save` wrote (oldest session first); a damaged file is deleted and logged."""
        if not path.exists():
            return 0
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != FILE_FORMAT or data.get("version") != FILE_VERSION:
                raise ValueError("not a ds4d session file of this version")
            turns = []
            for item in data["sessions"]:
                turn = Turn(str(item["request_id"]), tuple((str(r), str(d)) for r, d in item["messages"]),
                            str(item["prompt_text"]), array("l", item["prompt_ids"]), str(item["output_text"]),
                            array("l", item["output_ids"]))
                turns.append(((str(item["tenant"]), str(item["session"])), turn))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("session memory %s: deleting: %s", path, exc)
            path.unlink(missing_ok=True)
            return 0
        for key, turn in turns:
            self._sessions[key] = deque([turn], maxlen=self.turns_per_session)
            self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return len(turns)

    def stats(self) -> dict:
        return {"tracked": len(self._sessions), "prompts_continued_total": self.continued_total,
                "continued_tokens_total": self.continued_tokens_total, "reuse_misses_total": self.misses_total,
                "recent_misses": list(self.misses)}


_PREFIX_STEP = 4096


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences: equal slices are compared a block at a time
    (in C), then the differing block id by id (an agent's 68K-token prompt: under 1 ms, not 5)."""
    a = a if isinstance(a, list) else list(a)
    b = b if isinstance(b, list) else list(b)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + _PREFIX_STEP] == b[i : i + _PREFIX_STEP]:
        i += _PREFIX_STEP
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _first_changed_message(old: Sequence[tuple[str, str]], new: Sequence[tuple[str, str]]) -> tuple[int, str]:
    for i, (before, now) in enumerate(zip(old, new)):
        if before != now:
            return i, now[0]
    if len(new) > len(old):
        role = new[len(old)][0]
        return len(old), "assistant (the previous reply as sent back)" if role == "assistant" else role
    if len(new) < len(old):
        return len(new), "(messages removed)"
    return len(new), "(same messages: tools or template switches changed)"
