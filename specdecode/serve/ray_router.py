"""Routing for `specdecode serve --replicas N` (Ray Serve): cache-aware, with a bounded
imbalance, else the least-loaded replica.

Each replica keeps a prefix cache of the prompts it served (cache/blocks.py), and per-request
speculation state (lookup / suffix drafters) that drafts best where a conversation's history
is. As SGLang's router does, the ingress keeps an approximate index of what each replica has
seen: a request's conversation text is cut into chunks of CHUNK_CHARS characters, each named by
a hash covering the chunks before it (`routing_key`), and `AffinityRouter` (a Ray Serve custom
request router, which runs inside the ingress replica) sends the request to the replica that
holds the longest run of its chunks (its next turn: the whole previous conversation), unless
that replica has more than `imbalance` requests in flight above the least-loaded one. A request
that names its end user (OpenAI's `user`, or a Responses request's `prompt_cache_key`: an agent
session's) goes where that user went last, on the same terms.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

CHUNK_CHARS = 256          # characters per hashed chunk of a conversation's text
MAX_CHUNKS = 256           # chunks of one request indexed (the first 64k characters)
MAX_KEYS = 200_000         # remembered chunks and users (least recently used ones are forgotten)


@dataclass(frozen=True)
class RouteKey:
    user: str | None           # OpenAI's `user` field (Responses: else `prompt_cache_key`)
    chunks: tuple[str, ...]    # hashes of the conversation's text, chunk by chunk (each covers those before)


def conversation_text(body: dict) -> str | None:
    """A chat's messages (roles, text, tool calls), a Responses request's instructions and input
    items, or a completions prompt, as one string that a later turn extends."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(body.get("input"), (str, list)) and body["input"]:
        items = [body["input"]] if isinstance(body["input"], str) else body["input"]
        messages = [body.get("instructions")] + items
    if isinstance(messages, list) and messages:
        return "".join(json.dumps(m, sort_keys=True, ensure_ascii=False, default=str) + "\n" for m in messages)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt:
        return " ".join(map(str, prompt))
    return None


def routing_key(body: object) -> RouteKey | None:
    """The request's user and chunk hashes; None when it has neither (not a JSON object, no
    prompt): least-loaded routing."""
    if not isinstance(body, dict):
        return None
    user = next((body[name] for name in ("user", "prompt_cache_key") if isinstance(body.get(name), str) and body[name]),
                None)
    text = conversation_text(body)
    chunks, previous = [], b""
    for i in range(0, min(len(text or ""), CHUNK_CHARS * MAX_CHUNKS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        previous = hashlib.blake2b(previous + text[i:i + CHUNK_CHARS].encode(), digest_size=12).digest()
        chunks.append(previous.hex())
    if user is None and not chunks and text:
        chunks = [hashlib.blake2b(text.encode(), digest_size=12).hexdigest()]   # shorter than a chunk
    return RouteKey(user, tuple(chunks)) if user or chunks else None


class AffinityRouter(RequestRouter):
    """A request goes to the replica that served its user last, else to the one that holds the
    longest run of its chunks, while that replica's load (requests in flight, Ray Serve's queue
    length) is at most `imbalance` above the least-loaded candidate; everything else goes to the
    least-loaded replica (Ray Serve picks the lowest queue length among the candidates of a rank,
    probing replicas it has no fresh length for)."""

    # set in initialize_state, the constructor hook Ray Serve calls with request_router_kwargs
    imbalance: int
    max_keys: int
    owners: OrderedDict[str, ReplicaID]                 # user -> the replica that served them last
    holders: OrderedDict[str, set]                      # chunk hash -> replicas that saw it

    def initialize_state(self, imbalance: int = 8, max_keys: int = MAX_KEYS, **kwargs) -> None:
        if not isinstance(imbalance, int) or imbalance < 0:
            raise ValueError(f"imbalance must be an integer >= 0, got {imbalance!r}")
        self.imbalance, self.max_keys = imbalance, max_keys
        self.owners, self.holders = OrderedDict(), OrderedDict()

    @staticmethod
    def key_of(pending_request: PendingRequest | None) -> RouteKey | None:
        if pending_request is None or not pending_request.args:
            return None
        key = pending_request.args[0]          # by its fields: Ray may ship this class by value
        return key if hasattr(key, "user") and hasattr(key, "chunks") else None

    def load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def preferred(self, key: RouteKey, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The user's replica, else the replicas holding the longest run of the key's chunks."""
        if key.user is not None and key.user in self.owners:
            return [r for r in candidates if r.replica_id == self.owners[key.user]]
        best = list(candidates)
        for depth, chunk in enumerate(key.chunks):
            holders = self.holders.get(chunk, ())
            deeper = [r for r in best if r.replica_id in holders]
            if not deeper:
                return best if depth else []
            best = deeper
        return best if key.chunks else []

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = self.key_of(pending_request)
        if key is not None:
            least = min(self.load(r) for r in candidate_replicas)
            within = [r for r in self.preferred(key, candidate_replicas) if self.load(r) - least <= self.imbalance]
            if within:
                first = min(within, key=self.load)
                return [[first], [r for r in candidate_replicas if r is not first]]
        return [random.sample(candidate_replicas, len(candidate_replicas))]     # ties broken at random

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = self.key_of(pending_request)
        if key is None:
            return
        if key.user is not None:
            self.owners[key.user] = replica_id
            self.owners.move_to_end(key.user)
        for chunk in key.chunks:
            self.holders.setdefault(chunk, set()).add(replica_id)
            self.holders.move_to_end(chunk)
        for table in (self.owners, self.holders):
            while len(table) > self.max_keys:
                table.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for user in [u for u, owner in self.owners.items() if owner == replica_id]:
            del self.owners[user]
        for chunk in list(self.holders):
            self.holders[chunk].discard(replica_id)
            if not self.holders[chunk]:
                del self.holders[chunk]
