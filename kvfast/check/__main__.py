"""``python -m kvfast.check``: print the detector comparison table over the detector study's cases.

An entry point (the commands layer): it takes the default cases from the detector grid via
:mod:`kvfast.sweep.inline`.
"""

from kvfast.check.score import markdown
from kvfast.sweep.inline import compare_detectors

if __name__ == "__main__":
    print(markdown(compare_detectors()))
