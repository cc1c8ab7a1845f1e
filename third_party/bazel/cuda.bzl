"""`cuda_ops`: a CUDA shared library built with the host's nvcc, byte-reproducibly.

The command is the one engine/kernels/cuda_build.py `build` runs at run time (the same flags,
`--shared -Xcompiler -fPIC`, one `-gencode` for the architecture, the XLA FFI headers of the
lock's jaxlib), made independent of the build machine and of where the workspace lies:

- nvcc names its intermediate files after its process id and embeds those names in the library,
  so they are kept under fixed names in a directory of the target's own (`--keep --keep-dir`);
- nvcc names anonymous namespaces after a CRC of the source's absolute real path (cudafe++
  `--orig_src_path_name`), so that path is set to the source's workspace-relative path;
- every other path on the command line is relative to the execution root.

The host's nvcc (NVCC_PATH) is an impure input, like the host's Python.
"""

NVCC_PATH = "/usr/local/cuda/bin/nvcc"

# engine/plan.py KernelPlan.cuda_flags' default: what the engine builds the ops with
DEFAULT_FLAGS = ["-O3", "-std=c++17"]

def cuda_ops(
        name,
        src,
        arch,
        out,
        flags = DEFAULT_FLAGS,
        hdrs = ["@pypi//:headers"],
        includes = ["external/pypi/site/jaxlib/include"],
        nvcc = NVCC_PATH,
        **kwargs):
    """Compile and link the CUDA source `src` for sm_`arch` into the shared library `out`."""
    keep = "$(@D)/_nvcc_keep_%s" % name
    src_path = native.package_name() + "/" + src
    cmd = " ".join([
        "rm -rf %s && mkdir -p %s &&" % (keep, keep),
        nvcc,
        " ".join(flags),
        "--shared -Xcompiler -fPIC",
        "--keep --keep-dir %s" % keep,
        "-Xcudafe --orig_src_path_name=%s" % src_path,
        "-gencode=arch=compute_%s,code=sm_%s" % (arch, arch),
        " ".join(["-I" + inc for inc in includes]),
        "$(location %s)" % src,
        "-o $@ && chmod 0755 $@ && rm -rf %s" % keep,
    ])
    native.genrule(
        name = name,
        srcs = [src] + hdrs,
        outs = [out],
        cmd = cmd,
        message = "nvcc sm_%s %s" % (arch, out),
        **kwargs
    )
