"""The generated ctypes layer (fsdpturbo/_abi.py, made from the headers by scripts/gen_ctypes.py)
against the loaded library: every status of the header's enum is named by
fsdpturbo_status_name (so none is missing from the Rust enum's list) and classed by
fsdpturbo_status_class, every function is bound, and the package's errors carry those names."""
import ctypes

import pytest

from fsdpturbo import _abi, _native
from fsdpturbo._native import lib


def test_every_status_of_the_header_has_its_name():
    assert _abi.STATUS_NAMES[0] == "FSDPTURBO_OK" and len(_abi.STATUS_NAMES) >= 13
    for code, name in _abi.STATUS_NAMES.items():
        assert lib.fsdpturbo_status_name(code).decode() == name
        assert getattr(_abi, name) == code
    for code in (-1, 12, 98, 100, 2**31 - 1):
        assert code not in _abi.STATUS_NAMES
        assert lib.fsdpturbo_status_name(code) == b"FSDPTURBO_UNKNOWN_STATUS"
        assert lib.fsdpturbo_status_class(code) == _abi.FSDPTURBO_STATUS_CLASS_FAILURE


def test_every_status_has_a_class_and_check_raises_its_exception():
    exceptions = {_abi.FSDPTURBO_STATUS_CLASS_BAD_INPUT: _native.FSDPTurboValueError,
                  _abi.FSDPTURBO_STATUS_CLASS_NOT_FOUND: _native.FSDPTurboKeyError,
                  _abi.FSDPTURBO_STATUS_CLASS_FAILURE: _native.FSDPTurboError}
    assert lib.fsdpturbo_status_class(_abi.FSDPTURBO_OK) == _abi.FSDPTURBO_STATUS_CLASS_OK
    for code in _abi.STATUS_NAMES.keys() - {_abi.FSDPTURBO_OK}:
        expected = exceptions[lib.fsdpturbo_status_class(code)]
        with pytest.raises(_native.FSDPTurboError) as err:
            _native.check(code)
        assert type(err.value) is expected, _abi.STATUS_NAMES[code]


def test_every_function_of_both_headers_is_bound():
    for name, (restype, argtypes) in _abi.FUNCTIONS.items():
        fn = getattr(lib, name)
        assert fn.restype is restype and list(fn.argtypes) == argtypes, name
    assert lib.fsdpturbo_abi_version() == _abi.FSDPTURBO_ABI_VERSION


def test_errors_carry_the_status_name_without_its_prefix():
    assert lib.fsdpturbo_debug_panic() == _abi.FSDPTURBO_ERR_PANIC
    with pytest.raises(_native.FSDPTurboError, match="fsdpturbo_debug_panic was called") as err:
        _native.check(_abi.FSDPTURBO_ERR_PANIC)
    assert err.value.status == "PANIC"
    handle = ctypes.c_void_p()
    status = lib.fsdpturbo_config_parse(b"x: [", 4, ctypes.byref(handle))
    assert status == _abi.FSDPTURBO_ERR_CONFIG and not handle
    with pytest.raises(_native.FSDPTurboValueError) as err:
        _native.check(status)
    assert err.value.status == "CONFIG"
