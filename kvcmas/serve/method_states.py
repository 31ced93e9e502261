"""The worker's method objects, one per (namespace, method), bounded in number.

A method object holds what its method learns across requests (KVCMAS's anchor pools), so one
per namespace keeps tenants apart. Each is bounded by itself (V anchors per pool), but the
namespaces are not, so at most ``capacity`` objects are kept and the least recently used is
dropped: that tenant's next request starts with cold pools, as a new one would. No vllm
import here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvcmas.methods.base import Method
from kvcmas.serve.params import DEFAULT_NAMESPACES

Key = tuple[str | None, str]  # (namespace, method name)


class MethodStates:
    def __init__(self, make: Callable[[str], Method], capacity: int = DEFAULT_NAMESPACES):
        if capacity < 1:
            raise ValueError(f"need room for at least one method object, got {capacity}")
        self._make, self.capacity = make, capacity
        self._objects: OrderedDict[Key, Method] = OrderedDict()
        self.dropped = 0

    def get(self, namespace: str | None, name: str) -> Method:
        """The namespace's method object, made on first use; marks it recently used."""
        key = (namespace, name)
        if key in self._objects:
            self._objects.move_to_end(key)
        else:
            self._objects[key] = self._make(name)
            while len(self._objects) > self.capacity:
                self._objects.popitem(last=False)
                self.dropped += 1
        return self._objects[key]

    def items(self) -> Iterator[tuple[Key, Method]]:
        return iter(list(self._objects.items()))

    def values(self) -> Iterator[Method]:
        return iter(list(self._objects.values()))

    def __len__(self) -> int:
        return len(self._objects)
