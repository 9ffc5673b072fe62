"""Slurm node lists, for ``examples/cluster/ray.sub``: ``node[01-03]`` -> node01 node02 node03.

``scontrol show hostnames`` does this where Slurm is installed; the launcher falls back to

    python -m nemo_like.distributed.slurm hostnames 'gpu-[1,3-4],login1'

(one host per line, exit 2 with one line naming the list when it cannot be parsed), so its
``--dry-run`` works on any machine and is tested here.
"""

from __future__ import annotations

import re
import sys

__all__ = ["NodeListError", "expand_nodelist"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class NodeListError(ValueError):
    pass


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NodeListError("a ']' without its '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise NodeListError("a '[' without its ']'")
    parts.append("".join(cur))
    return parts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", item):
            raise NodeListError(f"{item!r} is not a host name")
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    out = []
    for rng in m.group(1).split(","):
        r = _RANGE.match(rng.strip())
        if r is None:
            raise NodeListError(f"{rng!r} in {item!r} is not a number or a range a-b")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise NodeListError(f"the range {rng!r} in {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0  # node[01-03]: zero-padded like its first bound
        for n in range(int(lo), int(hi) + 1):
            out += _expand_one(f"{head}{n:0{width}d}{tail}")  # a later bracket group (rack[1-2]-n[1-2])
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list, in order; duplicates are an error (a list names each host once)."""
    text = (nodelist or "").strip()
    if not text:
        raise NodeListError("the node list is empty")
    try:
        hosts = [h for item in _split_top(text) for h in _expand_one(item.strip())]
    except NodeListError as e:
        raise NodeListError(f"cannot parse the Slurm node list {nodelist!r}: {e}") from None
    seen = set()
    if dup := [h for h in hosts if h in seen or seen.add(h)]:
        raise NodeListError(f"the Slurm node list {nodelist!r} names {dup[0]!r} twice")
    return hosts


def wait_for_nodes(address: str, count: int, timeout_s: float, poll_s: float = 2.0) -> int:
    """Connect to the Ray cluster at ``address`` and wait until ``count`` nodes are alive; the number
    alive. Raises TimeoutError naming how many joined."""
    import time

    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
            if alive >= count:
                return alive
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{alive} of {count} Ray nodes joined {address} within {timeout_s:g} s")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


USAGE = ("usage: python -m nemo_like.distributed.slurm hostnames NODELIST\n"
         "       python -m nemo_like.distributed.slurm wait-for-nodes ADDRESS COUNT TIMEOUT_S")


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 2 and argv[0] == "hostnames":
            print("\n".join(expand_nodelist(argv[1])))
        elif len(argv) == 4 and argv[0] == "wait-for-nodes":
            n = wait_for_nodes(argv[1], int(argv[2]), float(argv[3]))
            print(f"[ray.sub] {n} Ray nodes alive at {argv[1]}")
        else:
            print(USAGE, file=sys.stderr)
            return 2
    except (NodeListError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
