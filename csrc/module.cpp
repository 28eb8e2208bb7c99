// The Python module dro_ext._C. It holds no Python functions: importing it runs the static
// TORCH_LIBRARY registrations of the other translation units, after which the ops live in torch.ops.dro_ext.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
