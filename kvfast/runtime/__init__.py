"""Running the user's code: a leaf (it imports only :mod:`kvfast.validation`), used by check, sweep and
the commands alike.

- :mod:`kvfast.runtime.user`: :func:`call_user` (whatever the user's code raises or exits with becomes
  one :class:`UserCodeError` naming the call; only a real Ctrl-C stays a ``KeyboardInterrupt``).
- :mod:`kvfast.runtime.interrupt`: :data:`INTERRUPTED`, :func:`on_sigint` and :func:`ctrl_c_noted`
  (a real Ctrl-C, told apart from a ``KeyboardInterrupt`` the user's code raises).
- :mod:`kvfast.runtime.load`: :func:`load_object`, a user's ``package.module:ATTR`` (or entry point)
  by one set of rules and messages: the working directory on ``sys.path``, ``ImportError`` as bad input,
  anything else as :class:`UserCodeError`, and (:func:`probing_imports`, the command line) ``os._exit``
  at import survived by a forked probe.
- :mod:`kvfast.runtime.deadline`: :func:`watched`, a deadline for the user's code in this process's
  main thread (a ``SIGALRM`` timer; :class:`CheckTimeout`).
- :mod:`kvfast.runtime.worker`: a sweep run's deadline in any thread (:func:`deadline`: timers;
  :class:`RunTimeout`) and a worker process that dies with its parent (:func:`worker_start`).
- :mod:`kvfast.runtime.child`: the user's code in a child process that this one survives
  (:func:`run_in_child`; ``kvfast check``'s isolation).
"""

from kvfast._lazy import lazy_exports

# public name -> the module that defines it, imported on first use: the command line imports
# :mod:`kvfast.runtime.child` before anything heavy (``kvfast.validation`` loads NumPy)
_EXPORTS = {
    "CheckTimeout": "kvfast.runtime.deadline",
    "check_timeout": "kvfast.runtime.deadline",
    "watched": "kvfast.runtime.deadline",
    "INTERRUPTED": "kvfast.runtime.interrupt",
    "ctrl_c_noted": "kvfast.runtime.interrupt",
    "on_sigint": "kvfast.runtime.interrupt",
    "load_object": "kvfast.runtime.load",
    "probing_imports": "kvfast.runtime.load",
    "split_ref": "kvfast.runtime.load",
    "ProcessEnded": "kvfast.runtime.user",
    "UserCodeError": "kvfast.runtime.user",
    "call_user": "kvfast.runtime.user",
    "describe": "kvfast.runtime.user",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, submodules=True)


__all__ = sorted(_EXPORTS)
