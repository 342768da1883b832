"""jaxcomp's benchmarks: one module per measurement, run from the repository root as
``python -m benchmarks.NAME`` (``--help`` lists the options, ``--quick`` is a smoke run).

:mod:`benchmarks.common` is the shared harness (results folder, JSON, plots, timing, the codec
list, the MLP of the step benchmarks, the digits data); :mod:`benchmarks.char_transformer` is
the character-level transformer of the convergence benchmarks. Results go to
``benchmarks/results/``, from where the docs hook renders them into tables.
"""
