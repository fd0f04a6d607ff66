// Empty stand-in for the host emulation (csrc/hostemu/shim.h defines what the kernels use).
#pragma once
