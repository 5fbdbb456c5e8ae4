"""A stand-in model server for process-handling tests (no model): serves GET /health on
127.0.0.x and prints SGLang-style rank-prefixed log lines. Used where the behaviour under
test is the toolkit's process and log handling, not inference (the real `transformers serve`
covers that). Standard library only.

    fake_server.py BIND PORT [--tp N] [--rank-line TEXT] [--line-of-rank R TEXT] [--skip-rank R]
                   [--ignore-term] [--child] [--die-at-start] [--no-health]
                   [--metrics FILE] [--server-info FILE] [--scheduler-procs]

--metrics / --server-info serve a file's current content at /metrics / /server_info (a test
rewrites it to move the numbers); --scheduler-procs runs one child per TP rank titled as SGLang
titles its scheduler processes (sglang::scheduler_TP<r>), for `server watch`'s rank health.
"""
import argparse
import http.server
import os
import signal
import socket
import subprocess
import sys
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bind")
    parser.add_argument("port", type=int)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank-line", action="append", default=[])
    parser.add_argument("--line-of-rank", nargs=2, action="append", default=[], metavar=("RANK", "TEXT"),
                        help="a line only rank RANK prints")
    parser.add_argument("--skip-rank", type=int, action="append", default=[])
    parser.add_argument("--ignore-term", action="store_true", help="trap SIGTERM and carry on")
    parser.add_argument("--child", action="store_true", help="also run a child (a 'TP worker') in the group")
    parser.add_argument("--die-at-start", action="store_true")
    parser.add_argument("--no-health", action="store_true", help="never answer /health")
    parser.add_argument("--metrics", help="serve this file at /metrics")
    parser.add_argument("--server-info", help="serve this file at /server_info")
    parser.add_argument("--scheduler-procs", action="store_true")
    options = parser.parse_args()

    if options.ignore_term:
        signal.signal(signal.SIGTERM, lambda *_: print("fake server: SIGTERM ignored", flush=True))
    if options.die_at_start:
        print("fake server: Traceback (most recent call last):\nRuntimeError: cannot load model", flush=True)
        sys.exit(3)
    if options.child:
        code = "import signal, time\n"
        if options.ignore_term:
            code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        code += "time.sleep(3600)\n"
        child = subprocess.Popen([sys.executable, "-c", code])
        print("fake server: worker pid %d" % child.pid, flush=True)
    if options.scheduler_procs:
        for rank in range(options.tp):
            title = "sglang::scheduler_TP%d" % rank if options.tp > 1 else "sglang::scheduler"
            subprocess.Popen([title, "-c", "import time; time.sleep(3600)"], executable=sys.executable)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for rank in range(options.tp):
        if rank in options.skip_rank:
            continue
        prefix = "[%s TP%d]" % (stamp, rank) if options.tp > 1 else "[%s]" % stamp
        for line in options.rank_line + [text for r, text in options.line_of_rank if int(r) == rank]:
            print("%s %s" % (prefix, line), flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            served = {"/metrics": options.metrics, "/server_info": options.server_info}.get(self.path)
            if served:
                with open(served, "rb") as handle:
                    body = handle.read()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            ok = self.path == "/health" and not options.no_health
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"starting")

        def log_message(self, fmt, *args):
            pass

    if ":" in options.bind:   # an IPv6 address such as ::1
        http.server.HTTPServer.address_family = socket.AF_INET6
    server = http.server.HTTPServer((options.bind, options.port), Handler)
    print("fake server: listening on %s:%d (pid %d)" % (options.bind, options.port, os.getpid()), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
