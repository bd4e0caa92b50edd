# A stand-in for nixpkgs, for evaluating flake.nix offline (tests/test_flake.py): the few library functions the flake
# uses, and packages that are attribute sets recording how they were called. It checks the flake's own logic and the
# shape of its outputs, not nixpkgs' API (only the pinned real nixpkgs can).
let
  lib = import ./lib.nix;
  mkPkgs =
    { system, config ? { } }:
    let
      pkg = name: {
        pname = name;
        outPath = "/nix/store/stub-${name}";
        overridePythonAttrs = f: pkg name // f (pkg name) // { overridden = true; };
      };
      pythonPackageNames = [
        "llama-cpp-python" "gguf" "numpy" "trio" "trio-websocket" "httpx" "attrs" "rich" "textual" "h11" "cattrs"
        "tomli-w" "platformdirs" "cryptography" "certifi" "setuptools" "pytest" "pytest-trio" "hypothesis" "mypy" "scikit-build-core"
        "pathspec" "pyproject-metadata" "typing-extensions" "diskcache" "jinja2"
      ];
      basePython = builtins.listToAttrs (map (n: { name = n; value = pkg n; }) pythonPackageNames);
      pkgs = {
        inherit system config;
        stdenv = {
          hostPlatform = {
            isx86_64 = lib.hasPrefix "x86_64-" system;
            isLinux = lib.hasSuffix "-linux" system;
          };
          cc = pkg "cc";
        };
        cudaPackages = { cuda_nvcc = pkg "nvcc"; cuda_cudart = pkg "cudart"; cuda_cccl = pkg "cccl"; libcublas = pkg "cublas"; };
        autoAddDriverRunpath = pkg "autoAddDriverRunpath";
        cmake = pkg "cmake";
        ninja = pkg "ninja";
        ruff = pkg "ruff";
        tmux = pkg "tmux";
        iproute2 = pkg "iproute2";
        nftables = pkg "nftables";
        writeShellScript = name: text: { inherit name text; outPath = "/nix/store/stub-${name}"; };
        runCommand = name: env: script: { inherit name script; };
        mkShell = attrs: attrs;
        python3.override =
          { self, packageOverrides }:
          let
            final = basePython // packageOverrides final basePython // {
              callPackage = f: args: (import f) (builtins.intersectAttrs (builtins.functionArgs (import f)) (pkgs // final // { inherit lib; }) // args);
              buildPythonPackage = attrs: attrs // { kind = "buildPythonPackage"; };
              buildPythonApplication = attrs: attrs // { kind = "buildPythonApplication"; outPath = "/nix/store/stub-${attrs.pname}"; };
              fetchPypi = attrs: attrs;
            };
          in
          {
            pkgs = final;
            withPackages = f: { withPackages = f final; };
          };
      };
    in
    pkgs;
in
{
  inherit lib;
  outPath = ./.;
  __functor = _: mkPkgs;
}
