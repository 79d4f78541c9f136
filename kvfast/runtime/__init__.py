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

# the public names, from the modules that define them (they import NumPy through kvfast.validation, as every
# command does; kvfast.runtime.child and kvfast.runtime.interrupt themselves import only the standard library)
from kvfast.runtime.deadline import CheckTimeout, check_timeout, watched  # noqa: F401
from kvfast.runtime.interrupt import INTERRUPTED, ctrl_c_noted, on_sigint  # noqa: F401
from kvfast.runtime.load import load_object, probing_imports, split_ref  # noqa: F401
from kvfast.runtime.user import ProcessEnded, UserCodeError, call_user, describe  # noqa: F401
