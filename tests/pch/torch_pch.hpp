// Precompiled header shared by the libtorch test binaries: libtorch's headers dominate build time.
#include <ATen/ATen.h>
#include <torch/torch.h>
#include <doctest/doctest.h>
