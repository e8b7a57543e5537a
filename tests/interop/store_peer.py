# The Python side of the TCPStore interoperability tests (tests/test_store_interop.cpp): PyTorch's
# own torch.distributed.TCPStore, as a client of a distrpc-hosted store ("client") or as the host
# a distrpc client joins ("server"). Prints one "name=value" line per observation; the C++ test
# checks them and the store's contents from its side.
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

mode, port = sys.argv[1], int(sys.argv[2])
TIMEOUT = timedelta(seconds=30)


def out(name, value):
    print(f"{name}={value}", flush=True)


def check(store, name, keys):
    # PyTorch 1.13's Python TCPStore has no check(); 2.x's has.
    if hasattr(store, "check"):
        out(name, store.check(keys))


def timed_wait(store, keys, ms):
    t0 = time.monotonic()
    try:
        store.wait(keys, timedelta(milliseconds=ms))
        out("wait_timeout", "none")
    except Exception as e:  # the type c10d raises differs across versions
        out("wait_timeout", type(e).__name__ + ": " + str(e).splitlines()[0])
    out("wait_timeout_ms", int((time.monotonic() - t0) * 1000))


if mode == "client":
    # Registers on "init/" like every c10d store object with a world size.
    s = TCPStore("127.0.0.1", port, 2, False, TIMEOUT)
    out("get_from_cpp", s.get("from_cpp").decode())
    out("add_cnt", s.add("cnt", 3))
    s.set("from_py", "world")
    s.set("binary", b"\x00\x01\xff")
    out("cs_missing", s.compare_set("cs", "", "first").decode())
    out("cs_swap", s.compare_set("cs", "first", "second").decode())
    out("cs_differs", s.compare_set("cs", "first", "third").decode())
    out("has_check", hasattr(s, "check"))
    check(s, "check_some_missing", ["from_cpp", "nope"])
    check(s, "check_present", ["from_cpp", "from_py"])
    s.wait(["from_cpp"])
    timed_wait(s, ["never"], 300)
    out("delete_present", s.delete_key("to_delete"))
    out("delete_absent", s.delete_key("to_delete"))
    out("num_keys", s.num_keys())
    s.set("py_done", "1")
    # Blocks until the C++ side has checked everything and answers.
    out("get_late", s.get("cpp_after").decode())
elif mode == "server":
    # Hosts the store; wait_for_workers (the default) blocks until the distrpc client registered.
    s = TCPStore("127.0.0.1", port, 2, True, TIMEOUT)
    out("hosting", "yes")
    s.set("from_py", "hello from python")
    s.add("cnt", 10)
    s.set("to_delete", "x")
    s.set("py_ready", "1")
    out("get_from_cpp", s.get("cpp_done").decode())
    out("cnt", s.add("cnt", 0))
    out("cs", s.get("cs").decode())
    out("has_check", hasattr(s, "check"))
    check(s, "check_deleted", ["to_delete"])
    out("binary", s.get("binary").hex())
    out("num_keys", s.num_keys())
    timed_wait(s, ["never"], 300)
    s.set("py_after", "late value")
    # Keeps serving until the C++ side is finished with the store.
    s.wait(["cpp_exit"])
    out("bye", "1")
else:
    sys.exit(f"store_peer.py: unknown mode {mode!r}; expected client or server")
