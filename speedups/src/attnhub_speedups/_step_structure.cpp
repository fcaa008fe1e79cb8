/* attnhub_speedups._step_structure: a step's STRUCTURE rules (attnhub/validation.py) and its
 * dense-batch test (validation.dense_batch), read through torch's C++ API, for
 * AttentionMetadataBuilder.build.
 *
 * step_structure(batch, block_size, device) -> bool. True only where every STRUCTURE rule holds
 * for (batch, spec with block_size, device) and every integer tensor of the batch is
 * contiguous: the batch is then used as it is. False where a rule fails, and wherever the
 * pass is cautious (anything it does not read as attnhub's Python rules would: a tensor
 * subclass, a sparse or symbolic-shaped tensor, a length that is not a Python int): attnhub
 * then runs its own rules, which decide and word the error. It never raises.
 *
 * Why C++: the rules are ~30 reads of tensor attributes (dtype, device, shape, is_contiguous),
 * 50-80 ns each through torch's Python bindings and about as much through the Python C API;
 * through at::Tensor they are a few ns each (docs/performance.md).
 *
 * The module is built against one torch (setup.py, from the torch in the build environment)
 * and links to its libraries; it records that torch's version (TORCH_BUILT_WITH), and attnhub
 * uses it only under the same version (validation._installed_step_structure).
 *
 * batch must be an instance of exactly the class given to bind() (attnhub's BatchMetadata:
 * plain attributes, no properties), device a torch.device. Not seen here: a method of a tensor
 * shadowed by an attribute of that tensor object (t.is_contiguous = ...), which Python's reads
 * would call.
 */
#include <Python.h>  // (first, as Python asks)
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>

// ATTNHUB_TORCH_VERSION: torch.__version__ at build time, unquoted (setup.py)
#define ATTNHUB_STRING(x) #x
#define ATTNHUB_STRING_OF(x) ATTNHUB_STRING(x)

namespace {

PyObject *batch_class = nullptr;  // attnhub.batch.BatchMetadata (bind)

// The batch's fields read here, interned once.
struct Names {
    PyObject *query_start_loc, *query_start_loc_cpu, *seq_lens, *seq_lens_cpu, *block_table,
        *block_table_cpu, *slot_mapping, *slot_mapping_cpu, *num_reqs, *num_actual_tokens,
        *block_size;
} names;

bool intern_names() {
    struct {
        PyObject **slot;
        const char *text;
    } all[] = {
        {&names.query_start_loc, "query_start_loc"},
        {&names.query_start_loc_cpu, "query_start_loc_cpu"},
        {&names.seq_lens, "seq_lens"},
        {&names.seq_lens_cpu, "seq_lens_cpu"},
        {&names.block_table, "block_table"},
        {&names.block_table_cpu, "block_table_cpu"},
        {&names.slot_mapping, "slot_mapping"},
        {&names.slot_mapping_cpu, "slot_mapping_cpu"},
        {&names.num_reqs, "num_reqs"},
        {&names.num_actual_tokens, "num_actual_tokens"},
        {&names.block_size, "block_size"},
    };
    for (auto &name : all) {
        *name.slot = PyUnicode_InternFromString(name.text);
        if (*name.slot == nullptr) return false;
    }
    return true;
}

// The batch's fields, read with getattr (not through its __dict__: asking CPython for an
// instance's dictionary turns its inline attribute values into a dict for good, which makes
// every later attribute read of that batch slower) and held until the pass returns.
class Fields {
  public:
    explicit Fields(PyObject *batch) : batch_(batch) {}
    ~Fields() {
        for (int i = 0; i < count_; ++i) Py_DECREF(held_[i]);
    }
    Fields(const Fields &) = delete;
    Fields &operator=(const Fields &) = delete;
    // batch.<name>, borrowed until the pass returns (nullptr where it is missing: cautious)
    PyObject *operator()(PyObject *name) {
        PyObject *value = PyObject_GetAttr(batch_, name);
        if (value == nullptr) {
            PyErr_Clear();
            return nullptr;
        }
        held_[count_++] = value;
        return value;
    }

  private:
    PyObject *batch_;
    PyObject *held_[16];  // (11 fields are read)
    int count_ = 0;
};

// The tensor held by obj where obj is a plain tensor (torch.Tensor or Parameter: no
// __torch_function__ of its own), strided and not nested (Python cannot read a nested
// tensor's shape), with concrete sizes; else nullptr (cautious).
const at::Tensor *plain_tensor(PyObject *obj) {
    if (obj == nullptr || !THPVariable_CheckExact(obj)) return nullptr;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != at::kStrided || t.is_nested()) return nullptr;
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return nullptr;
    return &t;
}

bool int_dtype(const at::Tensor &t) {
    auto s = t.scalar_type();
    return s == at::kInt || s == at::kLong;
}

bool same_device(const c10::Device &a, const c10::Device &b) {  // validation.same_device
    return a.type() == b.type() && (!a.has_index() || !b.has_index() || a.index() == b.index());
}

// A Python int that fits int64 (not a bool, not a subclass): the rules compare it with shapes.
bool as_int64(PyObject *obj, int64_t *out) {
    if (obj == nullptr || !PyLong_CheckExact(obj)) return false;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    *out = v;
    return true;
}

bool shape_is(const at::Tensor &t, int64_t n) { return t.dim() == 1 && t.size(0) == n; }

// "batch.{name}_cpu is None or (a host int copy of {name}'s shape)", contiguous.
bool host_copy_ok(PyObject *copy, const at::Tensor &of) {
    if (copy == Py_None) return true;
    const at::Tensor *t = plain_tensor(copy);
    return t != nullptr && t->sizes() == of.sizes() && t->is_cpu() && int_dtype(*t) &&
           t->is_contiguous();
}

// The STRUCTURE rules, in their order, and the dense-batch test.
bool structure_holds(Fields &field, PyObject *spec_block_size, const c10::Device &device) {
    // batch.block_size == spec.block_size (both plain ints)
    int64_t block_size, spec_bs;
    if (!as_int64(field(names.block_size), &block_size)) return false;
    if (!as_int64(spec_block_size, &spec_bs) || block_size != spec_bs) return false;
    const at::Tensor *qsl = plain_tensor(field(names.query_start_loc));
    const at::Tensor *seq = plain_tensor(field(names.seq_lens));
    const at::Tensor *table = plain_tensor(field(names.block_table));
    const at::Tensor *slots = plain_tensor(field(names.slot_mapping));
    const at::Tensor *qsl_cpu = plain_tensor(field(names.query_start_loc_cpu));
    const at::Tensor *seq_cpu = plain_tensor(field(names.seq_lens_cpu));
    if (!qsl || !seq || !table || !slots || !qsl_cpu || !seq_cpu) return false;
    const c10::Device dev = qsl->device();
    if (!same_device(dev, device)) return false;
    int64_t B;
    // (B < 0 fails the rules too: no tensor has B entries; INT64_MAX: B + 1 would overflow)
    if (!as_int64(field(names.num_reqs), &B) || B < 0 || B == INT64_MAX) return false;
    if (!shape_is(*qsl_cpu, B + 1) || !shape_is(*seq_cpu, B)) return false;
    if (!shape_is(*qsl, B + 1) || !shape_is(*seq, B)) return false;
    for (const at::Tensor *t : {qsl, seq, table, slots}) {
        if (!int_dtype(*t) || !t->is_contiguous()) return false;
    }
    for (const at::Tensor *t : {qsl_cpu, seq_cpu}) {
        if (!int_dtype(*t) || !t->is_cpu() || !t->is_contiguous()) return false;
    }
    for (const at::Tensor *t : {seq, table, slots}) {
        if (t->device() != dev) return false;
    }
    PyObject *table_cpu = field(names.block_table_cpu);
    PyObject *slots_cpu = field(names.slot_mapping_cpu);
    if (table_cpu == nullptr || slots_cpu == nullptr) return false;
    if (!host_copy_ok(table_cpu, *table) || !host_copy_ok(slots_cpu, *slots)) return false;
    if (table->dim() != 2 || table->size(0) != B) return false;
    if (B == 0) {  // B or batch.num_actual_tokens == 0
        int64_t tokens;
        if (!as_int64(field(names.num_actual_tokens), &tokens) || tokens != 0) return false;
    }
    return true;
}

PyObject *step_structure(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "step_structure(batch, block_size, device)");
        return nullptr;
    }
    // (under a TorchFunctionMode, Python's reads of a tensor's attributes go through the mode)
    if (batch_class == nullptr || Py_TYPE(args[0]) != (PyTypeObject *)batch_class ||
        !THPDevice_Check(args[2]) || at::impl::torch_function_mode_enabled()) {
        Py_RETURN_FALSE;
    }
    bool holds = false;
    {
        Fields fields(args[0]);
        try {
            holds =
                structure_holds(fields, args[1], reinterpret_cast<THPDevice *>(args[2])->device);
        } catch (...) {  // a c10::Error from an attribute read: cautious
            holds = false;
        }
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (holds) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

PyObject *bind(PyObject *, PyObject *cls) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "bind(cls): cls must be a class");
        return nullptr;
    }
    Py_INCREF(cls);
    Py_XSETREF(batch_class, cls);
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"step_structure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(step_structure)),
     METH_FASTCALL,
     "step_structure(batch, block_size, device) -> bool: the STRUCTURE rules and the dense-batch "
     "test hold (False: not, or not read here)."},
    {"bind", bind, METH_O, "bind(cls): the batch class step_structure accepts (exactly)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_step_structure", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__step_structure() {
    if (!intern_names()) return nullptr;
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr) return nullptr;
    if (PyModule_AddStringConstant(m, "TORCH_BUILT_WITH", ATTNHUB_STRING_OF(ATTNHUB_TORCH_VERSION)) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
