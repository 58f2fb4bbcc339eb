"""The reader of counts made plain floats (engine/step/count_uses.py) on functions written to a file: which uses it
finds, given the lines where the row check handed out a count of the vertex dimension (0)."""
import importlib.util
import textwrap

from pyg_pipe.engine.step.count_uses import first_float_use, float_use

SOURCE = textwrap.dedent('''
    import math


    def inverse(x):
        return x * (1.0 / x.size(0))


    def named(x):
        n = x.size(0)
        m = n - 1
        alpha = 0.5
        return x * (2 * alpha / m)


    def features(x):
        n, d = x.shape
        return x.view(n, -1) / math.sqrt(d) * 2.0 + x * (n * 0.5)


    def root(x):
        n, d = x.shape
        return x / math.sqrt(n)


    scale = lambda x: x * float(x.numel())  # noqa: E731
''')


def _module(tmp_path):
    path = tmp_path / "counted.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("counted", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reads(marker: str):
    """The (line, dimension 0) pairs of the file's lines that contain ``marker``."""
    lines = SOURCE.splitlines()
    return {(i + 1, 0) for i, line in enumerate(lines) if marker in line}


def test_counts_made_floats_are_found_and_feature_sizes_are_not(tmp_path):
    mod = _module(tmp_path)
    assert first_float_use(mod.inverse.__code__, _reads("x.size(0)"))[1] == "1.0 / x.size(0)"
    assert first_float_use(mod.named.__code__, _reads("n = x.size(0)"))[1] == "2 * alpha / m"
    # d (the features) is not the dimension read; n * 0.5 stays a count (the check follows it as it runs)
    assert first_float_use(mod.features.__code__, _reads("n, d = x.shape")) is None
    assert first_float_use(mod.root.__code__, _reads("n, d = x.shape"))[1] == "math.sqrt(n)"
    assert first_float_use(mod.scale.__code__, _reads("x.numel()"))[1] == "float(x.numel())"


def test_lines_where_no_count_was_read_are_not_read(tmp_path):
    mod = _module(tmp_path)
    assert first_float_use(mod.inverse.__code__, set()) is None
    assert first_float_use(mod.inverse.__code__, {(1, 0)}) is None
    found = float_use({mod.named.__code__: _reads("n = x.size(0)")})
    assert found.startswith("the forward makes a plain Python number of a size it read (`2 * alpha / m`)")
    assert "counted.py:" in found and "in named" in found


def test_code_without_source_is_not_read():
    code = compile("def f(x):\n    return 1.0 / x.size(0)\n", "<no source>", "exec").co_consts[0]
    assert float_use({code: {(2, 0)}}) is None
