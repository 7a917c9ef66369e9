"""Routing for `specdecode serve --replicas N` (Ray Serve): session / prefix affinity with a
bounded imbalance, else the least-loaded replica.

A replica keeps per-request speculation state (lookup / suffix drafters, the global suffix
tree): a conversation's next turn drafts best where its history is. The ingress computes a
routing key per request (`routing_key`) and passes it as the first argument of the engine
call; `AffinityRouter` (a Ray Serve custom request router, which runs inside the ingress
replica) sends a key to the replica that served it last, unless that replica has more than
`imbalance` requests in flight above the least-loaded one (then the key moves there).
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# A completions prompt's first characters identify its conversation: the next turn's prompt
# repeats the previous one and appends to it. About a system prompt plus a first question.
AFFINITY_PREFIX_CHARS = 512
MAX_KEYS = 100_000         # remembered conversations (least recently used ones are forgotten)


def routing_key(body: object) -> str | None:
    """`user:<name>` when the request names its end user (OpenAI's `user` field), else a hash of
    the conversation's start: the chat messages up to the first user message, or a completions
    prompt's first AFFINITY_PREFIX_CHARS characters (token ids: as many ids). None: no key
    (not a JSON object, no prompt): least-loaded routing."""
    if not isinstance(body, dict):
        return None
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list) and messages:
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                          len(messages) - 1)
        start = messages[:first_user + 1]
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        start = prompt[0][:AFFINITY_PREFIX_CHARS]
    elif isinstance(prompt, (str, list)) and prompt:
        start = prompt[:AFFINITY_PREFIX_CHARS]
    else:
        return None
    text = json.dumps(start, sort_keys=True, ensure_ascii=False, default=str)
    return "prefix:" + hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


class AffinityRouter(RequestRouter):
    """Keyed requests go to the replica that served their key while its load (requests in
    flight, Ray Serve's queue length) is at most `imbalance` above the least-loaded candidate;
    everything else goes to the least-loaded replica (Ray Serve picks the lowest queue length
    among the candidates of a rank, probing replicas it has no fresh length for)."""

    # set in initialize_state, the constructor hook Ray Serve calls with request_router_kwargs
    imbalance: int
    max_keys: int
    owners: OrderedDict[str, ReplicaID]

    def initialize_state(self, imbalance: int = 8, max_keys: int = MAX_KEYS, **kwargs) -> None:
        if not isinstance(imbalance, int) or imbalance < 0:
            raise ValueError(f"imbalance must be an integer >= 0, got {imbalance!r}")
        self.imbalance, self.max_keys = imbalance, max_keys
        self.owners: OrderedDict[str, ReplicaID] = OrderedDict()

    @staticmethod
    def key_of(pending_request: PendingRequest | None) -> str | None:
        if pending_request is None or not pending_request.args:
            return None
        key = pending_request.args[0]
        return key if isinstance(key, str) else None

    def load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = self.key_of(pending_request)
        owner_id = self.owners.get(key) if key is not None else None
        owner = next((r for r in candidate_replicas if r.replica_id == owner_id), None)
        if owner is not None:
            least = min(self.load(r) for r in candidate_replicas)
            if self.load(owner) - least <= self.imbalance:
                return [[owner], [r for r in candidate_replicas if r is not owner]]
        return [random.sample(candidate_replicas, len(candidate_replicas))]     # ties broken at random

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = self.key_of(pending_request)
        if key is None:
            return
        self.owners[key] = replica_id
        self.owners.move_to_end(key)
        while len(self.owners) > self.max_keys:
            self.owners.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self.owners.items() if owner == replica_id]:
            del self.owners[key]
