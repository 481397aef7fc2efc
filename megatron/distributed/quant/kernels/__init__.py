"""Numerical core of the quantized collectives: group-wise symmetric 2/4/8-bit quantization.

* :mod:`.dispatch` -- the public ops (quantize, dequantize, the fused collective hops, the
  non-finite counts) and the backend switch (``QUANT_KERNELS``) that sends each call to a backend;
* :mod:`.reference` -- the PyTorch reference: the numerical definition, and the data types
  (:class:`~.reference.QuantizedTensor`, :class:`~.reference.NoiseIndex`, ...);
* :mod:`.hadamard` -- the block Hadamard transform;
* :mod:`.triton_launch` -- the Triton backend's host launchers, of the device kernels in
  :mod:`.triton_device`;
* :mod:`.cpu_kernels` -- the fused C++ CPU backend (``cpu_kernels.cpp``, built at first use).

Nothing is re-exported here: import from the module that defines a name.
"""
