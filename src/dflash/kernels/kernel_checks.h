// Argument checks of the CPU kernels: a failed check throws std::runtime_error with its message, which the Python
// bindings raise as RuntimeError (as TORCH_CHECK's c10::Error is). Standard exceptions are used rather than
// c10::Error so that the checks need nothing of torch, and because with some toolchains (torch 2.11 + CUDA 13
// wheels, gcc 13.3) a c10::Error thrown inside a freshly built extension ended the process instead of being raised.
#pragma once

#include <sstream>
#include <stdexcept>
#include <utility>

namespace kernel_checks {

template <typename... Parts>
[[noreturn]] void refuse(Parts&&... parts) {
  std::ostringstream message;
  (message << ... << std::forward<Parts>(parts));
  throw std::runtime_error(message.str());
}

}  // namespace kernel_checks

// DFLASH_CHECK(condition, message parts...): the parts streamed into the message when the condition is false.
#define DFLASH_CHECK(condition, ...)                            \
  do {                                                          \
    if (!(condition)) ::kernel_checks::refuse(__VA_ARGS__);     \
  } while (false)
