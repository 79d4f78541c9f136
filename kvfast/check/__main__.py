"""``python -m kvfast.check``: print the detector comparison table over the detector study's cases."""

from kvfast.check.score import compare_detectors, markdown

if __name__ == "__main__":
    print(markdown(compare_detectors()))
