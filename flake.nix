{
  description = "Kvasir: one large language model across a ring of ordinary devices, with no central master";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";
    flake-utils.url = "github:numtide/flake-utils";
  };

  outputs = { self, nixpkgs, flake-utils }:
    flake-utils.lib.eachDefaultSystem (system:
      let
        pkgs = import nixpkgs { inherit system; };
        python = pkgs.python311.override {
          packageOverrides = final: prev: {
            # The stage recipe was validated bit-exact on exactly this version (docs/stage-gguf.md); the sdist
            # carries its own llama.cpp.
            llama-cpp-python = prev.llama-cpp-python.overridePythonAttrs (old: rec {
              version = "0.3.36";
              src = final.fetchPypi {
                pname = "llama_cpp_python";
                inherit version;
                hash = "sha256-gy2waZAH8b6Vp+Qe8S6IkmsCuoNkYeNqNjctsnYMGi4=";
              };
              patches = [ ];
              # Portable x86_64 build: ggml's native build enables AMX kernels that crash in VMs without AMX state.
              cmakeFlags = (old.cmakeFlags or [ ]) ++ pkgs.lib.optionals pkgs.stdenv.hostPlatform.isx86_64 [
                "-DGGML_NATIVE=OFF" "-DGGML_AVX=ON" "-DGGML_AVX2=ON" "-DGGML_FMA=ON" "-DGGML_F16C=ON"
              ];
              doCheck = false;
            });
          };
        };
        deps = ps: with ps; [ llama-cpp-python gguf numpy trio trio-websocket attrs rich textual h11 httpx ];
        kvasir = python.pkgs.buildPythonApplication {
          pname = "kvasir";
          version = "0.1.0";
          pyproject = true;
          src = ./.;
          build-system = [ python.pkgs.setuptools ];
          dependencies = deps python.pkgs;
          doCheck = false;
        };
        app = args: {
          type = "app";
          program = toString (pkgs.writeShellScript "kvasir-app" ''
            exec ${kvasir}/bin/kvasir ${args} "$@"
          '');
        };
      in {
        packages.default = kvasir;
        packages.kvasir = kvasir;
        apps.default = app "";
        # `nix run .#node -- --manifest ring.toml --rank 1 --model model.gguf`
        apps.node = app "node";
        apps.tui = app "tui";
        apps.relay = app "relay";
        devShells.default = pkgs.mkShell {
          packages = [ (python.withPackages (ps: deps ps ++ [ ps.pytest ps.pytest-trio ps.hypothesis ]))
                       pkgs.tmux pkgs.iproute2 pkgs.nftables ];
        };
      });
}
