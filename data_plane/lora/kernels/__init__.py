"""Kernels behind the mixed-adapter LoRA ops: compiled for the CPU (bgmv_cpu.cpp), Triton for CUDA."""
