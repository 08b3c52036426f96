"""(CPU tier) Kernel arguments are packed by each kernel's declared
signature, and arguments that do not fit it are refused before a launch."""
import re
import struct

import pytest

from cupy_fused import _bridge, _runtime


class _FakeKernel:
    def __init__(self, name):
        self.name, self.ptr, self.params, self.shared_limit = name, 0, None, 48 * 1024
        self.wide_params = False


def _all_instantiations():
    return [expr for exprs in _runtime.declared().values() for expr in exprs]


def test_every_declared_instantiation_has_a_signature_of_known_parameters():
    """Pointers, i64 and doubles (8 bytes) and TMA descriptors (128 bytes)."""
    names = _all_instantiations()
    assert names
    for expr in names:
        layout = _bridge.kernel_signature(expr)
        codes = re.findall(r"\d*[a-z]", layout.format.lstrip("<"))
        assert codes and set(codes) <= {"q", "d", "128s"}, (expr, codes)
        assert layout.size == sum(128 if c == "128s" else 8 for c in codes)
        if "128s" in codes:  # a pointer array of its own, at every parameter's offset
            offsets = _bridge._IRREGULAR[layout.format]
            assert offsets[0] == 0 and len(offsets) == len(codes)


def test_kernel_names_are_unique_across_the_sources():
    """The signature is found by the kernel's plain name: one declaration each."""
    seen = {}
    paths = _runtime.source_paths(_runtime.kernel_dir())
    assert {p.name for p in paths if p.suffix == ".cu"} == set(_runtime.declared())  # (the ops' sources)
    for path in paths:
        for match in _bridge._GLOBAL.finditer(path.read_text()):
            name = match.group(1)
            assert name not in seen, (name, seen.get(name), path.name)
            seen[name] = path.name
    # The parser finds every __global__ function of the sources.
    total = sum(len(re.findall(r"__global__\s+void", p.read_text()))
                for p in paths)
    assert len(seen) == total


def test_layout_follows_the_declaration():
    # scale_add(const T* x, const T* y, T* out, double alpha, i64 n)
    assert _bridge.kernel_signature("cf::scale_add<float>").format.lstrip("<") == "qqqdq"
    # An int where a double is declared packs as a double.
    buf = bytearray(40)
    _bridge.kernel_signature("cf::scale_add<float>").pack_into(buf, 0, 1, 2, 3, 2, 5)
    assert struct.unpack_from("<d", buf, 24)[0] == 2.0


@pytest.mark.parametrize("args, message", [
    ((1, 2, 3, 0.5), "4 arguments for its 5 parameters"),
    ((1, 2, 3, 0.5, 5, 6), "6 arguments for its 5 parameters"),
    ((1, 2, 3, 0.5, 5.0), "argument 4 must be an int"),
    ((1, 2, 3, "x", 5), "argument 3 must be a float"),
])
def test_arguments_that_do_not_fit_are_refused_before_launch(monkeypatch, args, message):
    launched = []
    monkeypatch.setattr(_bridge, "_launch_kernel", lambda *a: launched.append(a))
    monkeypatch.setattr(_bridge, "_ParamBuffer", lambda: type(
        "B", (), {"data": bytearray(4096), "params_ptr": 0})())
    monkeypatch.setattr(_bridge._local, "buffer", _bridge._ParamBuffer(), raising=False)
    with pytest.raises(TypeError, match=re.escape(message)):
        _bridge.launch(_FakeKernel("cf::scale_add<float>"), (1, 1, 1), 32, args, 0)
    assert not launched


def test_a_parameter_of_another_width_is_refused():
    with pytest.raises(TypeError, match="not a pointer, i64, double or TensorMap"):
        _bridge._parameter_code("k", " int n")


def test_tensor_maps_pack_as_128_bytes_and_other_lengths_are_refused(monkeypatch):
    """gemm_wgmma(TensorMap a, TensorMap b, TensorMap c, T* c, const T* bias,
    i64 act, i64 M, i64 N, i64 K, i64 ldc): each map at its own offset."""
    expr = "cf::gemm_wgmma<cf::half, 4, true>"
    layout = _bridge.kernel_signature(expr)
    assert _bridge._IRREGULAR[layout.format] == (0, 128, 256, 384, 392, 400, 408, 416, 424, 432)
    launched = []
    monkeypatch.setattr(_bridge, "_launch_kernel", lambda *a: launched.append(a))
    monkeypatch.setattr(_bridge, "_get_device", lambda: 0)
    monkeypatch.setattr(_bridge, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(_bridge._local, "buffer", _bridge._ParamBuffer(), raising=False)
    maps = [bytes([i]) * 128 for i in (1, 2, 3)]
    _bridge.launch(_FakeKernel(expr), (1, 1, 1), 384, (*maps, 7, 0, 1, 2, 3, 4, 5), 0)
    assert len(launched) == 1
    data = bytes(_bridge._local.buffer.data)
    assert data[:384] == b"".join(maps) and struct.unpack_from("<q", data, 384)[0] == 7
    with pytest.raises(TypeError, match="argument 1 must be 128 bytes"):
        _bridge.launch(_FakeKernel(expr), (1, 1, 1), 384,
                       (maps[0], maps[1][:64], maps[2], 7, 0, 1, 2, 3, 4, 5), 0)
    assert len(launched) == 1
