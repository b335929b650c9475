#include <nanobind/nanobind.h>
namespace nb = nanobind;
NB_MODULE(_native, m) { m.doc() = "engram_mmap native gather (work in progress)"; }
