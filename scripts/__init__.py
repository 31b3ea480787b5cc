"""Runnable scripts, one folder per purpose (docs/architecture.md, "Module map"):

demo.py, build_tiny_pair.py   `make demo`; rebuilding the shipped tiny pair
serving/                      a server or engine under load (load test, step phases, soak, ...)
bench/                        one component at a time, no server (ops, draft step, training, ...)
gpu/                          the GPU machine's kit: built here, run there (`make gpu-*`)
"""
