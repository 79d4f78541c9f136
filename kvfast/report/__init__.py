"""The report: the claims table, the quoted figures and the plots, computed from stored results alone.

Sits between :mod:`kvfast.sweep` and :mod:`kvfast.commands` in the one-way
import order. ``kvfast report RESULTS_DIR`` (and the end of ``kvfast
reproduce``) calls :func:`kvfast.report.page.write_report`.
"""
