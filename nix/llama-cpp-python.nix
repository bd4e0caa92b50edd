# llama-cpp-python, owned here rather than overridden from nixpkgs: Kvasir's stage code mirrors the structs of exactly
# the llama.cpp vendored in this version (kvasir/stage/llama_ffi.py), so the recipe must build that vendored copy with
# our flags, whatever nixpkgs' own recipe does at the pinned revision. The PyPI sdist carries vendor/llama.cpp.
{
  lib,
  stdenv,
  buildPythonPackage,
  fetchPypi,
  cmake,
  ninja,
  scikit-build-core,
  pathspec,
  pyproject-metadata,
  numpy,
  typing-extensions,
  diskcache,
  jinja2,
  version,
  cmakeFlags,
  cudaSupport ? false,
  cudaPackages ? { },
  # Points the CUDA libraries at the host's driver (/run/opengl-driver/lib); without it libcuda.so is not found.
  autoAddDriverRunpath ? null,
}:
let
  # sha256 of the PyPI sdist, one entry per version the pin in pyproject.toml may name.
  hashes = {
    "0.3.36" = "sha256-gy2waZAH8b6Vp+Qe8S6IkmsCuoNkYeNqNjctsnYMGi4=";
  };
in
buildPythonPackage {
  pname = "llama-cpp-python";
  inherit version;
  pyproject = true;
  src = fetchPypi {
    pname = "llama_cpp_python";
    inherit version;
    hash = hashes.${version} or (throw "nix/llama-cpp-python.nix: no sdist hash for llama-cpp-python ${version}");
  };
  # scikit-build-core runs cmake itself; the flags go in explicitly (not through a setup hook that varies by revision).
  dontUseCmakeConfigure = true;
  env.SKBUILD_CMAKE_ARGS = lib.concatStringsSep ";" (
    cmakeFlags
    ++ lib.optionals cudaSupport [
      "-DGGML_CUDA=ON"
      "-DCUDAToolkit_ROOT=${lib.getDev cudaPackages.cuda_nvcc}"
      "-DCMAKE_CUDA_COMPILER=${lib.getExe cudaPackages.cuda_nvcc}"
    ]
  );
  preBuild = ''
    export CMAKE_BUILD_PARALLEL_LEVEL="$NIX_BUILD_CORES"
  '';
  nativeBuildInputs = [
    cmake
    ninja
  ]
  ++ lib.optionals cudaSupport [ autoAddDriverRunpath ];
  build-system = [
    scikit-build-core
    pathspec
    pyproject-metadata
  ];
  buildInputs = lib.optionals cudaSupport (
    with cudaPackages;
    [
      cuda_cudart
      cuda_cccl
      libcublas
    ]
  );
  dependencies = [
    numpy
    typing-extensions
    diskcache
    jinja2
  ];
  doCheck = false; # its tests download models
  pythonImportsCheck = [ "llama_cpp" ];
  meta = {
    description = "Python bindings for llama.cpp (the version Kvasir's stage recipe was validated on)";
    homepage = "https://github.com/abetlen/llama-cpp-python";
    license = lib.licenses.mit;
  };
}
