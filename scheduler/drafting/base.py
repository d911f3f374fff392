"""The drafter interface."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request


class Drafter(ABC):
    """Proposes draft tokens for a decoding request from tokens alone (no model).

    Contract: ``propose`` returns at most ``k`` tokens (``[]``: no draft) and changes nothing
    the scheduler reads; ``finish`` is called once for every request that leaves the scheduler
    (any finish path, abort included), after which the drafter holds no state keyed by it
    except what it keeps on purpose across requests (bounded).
    """

    @abstractmethod
    def propose(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` tokens expected to follow ``request.all_token_ids``."""

    def finish(self, request: Request, completed: bool) -> None:
        """``request`` left the scheduler; ``completed``: it finished on a stop or its length
        (not an abort or an error), so its output is a whole answer."""
