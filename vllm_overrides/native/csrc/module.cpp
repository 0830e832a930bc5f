// Python module entry point of the vo_native_kernels library: importing it loads the library,
// whose TORCH_LIBRARY blocks register torch.ops.vo_kernels (no Python bindings needed).
#include <Python.h>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME vo_native_kernels
#endif
#define VO_CONCAT_(a, b) a##b
#define VO_CONCAT(a, b) VO_CONCAT_(a, b)
#define VO_STR_(a) #a
#define VO_STR(a) VO_STR_(a)

extern "C" PyMODINIT_FUNC VO_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, VO_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                            nullptr};
  return PyModule_Create(&def);
}
