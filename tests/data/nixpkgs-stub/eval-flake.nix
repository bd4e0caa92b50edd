# What tests/test_flake.py checks of flake.nix, evaluated against the stub nixpkgs next to this file.
let
  flake = import ../../../flake.nix;
  out = flake.outputs {
    self = out;
    nixpkgs = import ./.;
  };
  dep = system: name: builtins.head (builtins.filter (d: d.pname == name) out.packages.${system}.default.dependencies);
  cudaLlama = builtins.head (
    builtins.filter (d: d.pname == "llama-cpp-python") out.packages.x86_64-linux.cuda.dependencies
  );
in
{
  packages = builtins.mapAttrs (_: builtins.attrNames) out.packages;
  apps = builtins.mapAttrs (_: apps: builtins.mapAttrs (_: app: { inherit (app) type meta; }) apps) out.apps;
  checks = builtins.mapAttrs (_: builtins.attrNames) out.checks;
  devShells = builtins.mapAttrs (_: shells: map (p: p.pname or "python") shells.default.packages) out.devShells;
  kvasir = {
    inherit (out.packages.x86_64-linux.default) version pythonRelaxDeps pythonImportsCheck preBuild;
    makeWrapperArgs = out.packages.x86_64-linux.default.makeWrapperArgs or [ ];
    files = map toString out.packages.x86_64-linux.default.src.fileset or [ ];
    dependencies = map (d: d.pname) out.packages.x86_64-linux.default.dependencies;
  };
  llamaArgs = builtins.mapAttrs (system: _: (dep system "llama-cpp-python").env.SKBUILD_CMAKE_ARGS) out.packages;
  llamaVersion = (dep "x86_64-linux" "llama-cpp-python").version;
  cudaArgs = cudaLlama.env.SKBUILD_CMAKE_ARGS;
  cudaNativeInputs = map (p: p.pname) cudaLlama.nativeBuildInputs;
  cpuNativeInputs = map (p: p.pname) (dep "x86_64-linux" "llama-cpp-python").nativeBuildInputs;
  ggufWithoutPyside = (dep "x86_64-linux" "gguf").overridden or false;
}
