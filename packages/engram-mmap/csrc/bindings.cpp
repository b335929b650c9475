// Python bindings of the native gather. Array arguments arrive as generic DLPack/buffer views
// (numpy arrays, torch CPU tensors, pinned or not) and are validated here with messages that name
// the argument, since nanobind's own type errors do not say which check failed.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <tuple>

#include "mapping.h"
#include "table.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace engram_mmap;

namespace {

void check_host(const nb::ndarray<>& a, const char* name) {
  const int dev = a.device_type();
  if (dev != nb::device::cpu::value && dev != nb::device::cuda_host::value)
    throw nb::value_error((std::string(name) + " must live in host memory (a numpy array or a CPU/pinned tensor), "
                           "got DLPack device type " + std::to_string(dev))
                              .c_str());
}

bool c_contiguous(const nb::ndarray<>& a) {
  int64_t expected = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected) return false;
    expected *= (int64_t)a.shape(d);
  }
  return true;
}

std::string shape_str(const nb::ndarray<>& a) {
  std::string s = "(";
  for (size_t d = 0; d < a.ndim(); ++d) s += (d ? ", " : "") + std::to_string(a.shape(d));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

const int64_t* ids_view(const nb::ndarray<>& a, size_t* n) {
  check_host(a, "row_ids");
  auto dt = a.dtype();
  if (dt.code != (uint8_t)nb::dlpack::dtype_code::Int || dt.bits != 64 || dt.lanes != 1)
    throw nb::type_error("row_ids must be int64");
  if (!c_contiguous(a)) throw nb::value_error("row_ids must be C-contiguous");
  *n = a.size();
  return static_cast<const int64_t*>(a.data());
}

uint8_t* out_view(const nb::ndarray<>& a, const char* name, size_t n, uint64_t cols) {
  check_host(a, name);
  auto dt = a.dtype();
  if (dt.bits != 8 || dt.lanes != 1)
    throw nb::type_error((std::string(name) + " must have a 1-byte dtype (uint8, int8 or float8), got " +
                          std::to_string(dt.bits) + "-bit elements")
                             .c_str());
  if (a.ndim() < 1 || a.shape(a.ndim() - 1) != cols || a.size() != n * cols)
    throw nb::value_error((std::string(name) + " must hold " + std::to_string(n) + " rows of " +
                           std::to_string(cols) + " bytes (last dimension " + std::to_string(cols) + "), got shape " +
                           shape_str(a))
                              .c_str());
  if (!c_contiguous(a)) throw nb::value_error((std::string(name) + " must be C-contiguous").c_str());
  return static_cast<uint8_t*>(a.data());
}

// An asynchronous gather as Python sees it: the work plus references that keep the row ids and the
// output buffers alive until the work is done. Dropping it waits for the work.
struct PendingGather {
  std::shared_ptr<Work> work;
  nb::ndarray<> ids, out_weight, out_scale;
  ~PendingGather() {
    if (work) {
      try {
        work->wait();
      } catch (...) {
      }
    }
  }
};

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "engram_mmap native core: file mappings and the parallel row gather";

  nb::class_<Mapping>(m, "Mapping", "A read-only shared mapping of one whole file.")
      .def(nb::init<int, uint64_t, const std::string&, bool>(), "fd"_a, "size"_a, "path"_a, "random_access"_a)
      .def_prop_ro("size", &Mapping::size)
      .def_prop_ro("path", &Mapping::path)
      .def_prop_ro("closed", &Mapping::closed)
      .def("close", &Mapping::close)
      .def("current_file_size", &Mapping::current_file_size)
      .def("evict", &Mapping::evict, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "resident",
          [](const Mapping& mp, uint64_t offset, uint64_t length) {
            uint64_t res = 0, total = 0;
            {
              nb::gil_scoped_release release;
              mp.resident(offset, length, &res, &total);
            }
            return std::make_tuple(res, total);
          },
          "offset"_a, "length"_a, "(resident pages, pages) of a byte range, from mincore");

  nb::class_<Work>(m, "Work", "Completion of an asynchronous prefetch.")
      .def("done", &Work::done)
      .def("wait", &Work::wait, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<PendingGather>(m, "PendingGather", "Completion of an asynchronous gather.")
      .def("done", [](PendingGather& p) { return p.work->done(); })
      .def("wait", [](PendingGather& p) {
        nb::gil_scoped_release release;
        return p.work->wait();
      });

  nb::class_<Table>(m, "Table", "The row gather over a mapped weight tensor and its scale tensor.")
      .def(
          "__init__",
          [](Table* t, std::shared_ptr<Mapping> weight_mapping, uint64_t weight_offset, uint64_t weight_row_bytes,
             std::shared_ptr<Mapping> scale_mapping, uint64_t scale_offset, uint64_t scale_row_bytes, uint64_t rows,
             int n_threads, bool dedup, uint64_t readahead_max_rows, bool resident_scales) {
            new (t) Table(TensorSpan{std::move(weight_mapping), weight_offset, weight_row_bytes},
                          TensorSpan{std::move(scale_mapping), scale_offset, scale_row_bytes}, rows, n_threads, dedup,
                          readahead_max_rows, resident_scales);
          },
          "weight_mapping"_a, "weight_offset"_a, "weight_row_bytes"_a, "scale_mapping"_a, "scale_offset"_a,
          "scale_row_bytes"_a, "rows"_a, "n_threads"_a, "dedup"_a, "readahead_max_rows"_a, "resident_scales"_a)
      .def_prop_ro("rows", &Table::rows)
      .def_prop_ro("n_threads", &Table::n_threads)
      .def_prop_ro("closed", &Table::closed)
      .def_prop_ro("resident_scales", &Table::resident_scales)
      .def(
          "gather",
          [](Table& t, nb::ndarray<> ids, nb::ndarray<> out_weight, nb::ndarray<> out_scale, bool zero_invalid) {
            size_t n = 0;
            const int64_t* p = ids_view(ids, &n);
            uint8_t* w = out_view(out_weight, "out_rows", n, t.weight_row_bytes());
            uint8_t* s = out_view(out_scale, "out_scales", n, t.scale_row_bytes());
            nb::gil_scoped_release release;
            return t.gather(p, n, w, s, zero_invalid);
          },
          "row_ids"_a, "out_rows"_a, "out_scales"_a, "zero_invalid"_a = false,
          "Gather rows; returns the number of distinct rows read. zero_invalid: ids outside the table give zero "
          "bytes instead of an error.")
      .def(
          "gather_async",
          [](Table& t, nb::ndarray<> ids, nb::ndarray<> out_weight, nb::ndarray<> out_scale, bool zero_invalid) {
            size_t n = 0;
            const int64_t* p = ids_view(ids, &n);
            uint8_t* w = out_view(out_weight, "out_rows", n, t.weight_row_bytes());
            uint8_t* s = out_view(out_scale, "out_scales", n, t.scale_row_bytes());
            auto pending = new PendingGather{nullptr, ids, out_weight, out_scale};
            try {
              nb::gil_scoped_release release;
              pending->work = t.gather_async(p, n, w, s, zero_invalid);
            } catch (...) {
              delete pending;
              throw;
            }
            return pending;
          },
          "row_ids"_a, "out_rows"_a, "out_scales"_a, "zero_invalid"_a = false, nb::rv_policy::take_ownership)
      .def(
          "prefetch",
          [](Table& t, nb::ndarray<> ids) {
            size_t n = 0;
            const int64_t* p = ids_view(ids, &n);
            nb::gil_scoped_release release;
            t.prefetch(p, n);
          },
          "row_ids"_a)
      .def(
          "prefetch_async",
          [](Table& t, nb::ndarray<> ids) {
            size_t n = 0;
            const int64_t* p = ids_view(ids, &n);
            std::vector<int64_t> copy(p, p + n);
            nb::gil_scoped_release release;
            return t.prefetch_async(std::move(copy));
          },
          "row_ids"_a)
      .def("close", &Table::close, nb::call_guard<nb::gil_scoped_release>());

  m.def("random_read", &random_read, "path"_a, "lo"_a, "hi"_a, "n_reads"_a, "n_threads"_a, "block"_a, "direct"_a,
        "seed"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Wall seconds for n_reads random block reads (pread, O_DIRECT when direct) of [lo, hi) of a file.");
}
