# The nixpkgs library functions flake.nix and nix/llama-cpp-python.nix use, with nixpkgs' semantics, from builtins.
rec {
  hasPrefix = pre: s: builtins.substring 0 (builtins.stringLength pre) s == pre;
  hasSuffix =
    suf: s:
    let
      ls = builtins.stringLength s;
      lf = builtins.stringLength suf;
    in
    ls >= lf && builtins.substring (ls - lf) lf s == suf;
  removePrefix =
    pre: s:
    if hasPrefix pre s then
      builtins.substring (builtins.stringLength pre) (builtins.stringLength s - builtins.stringLength pre) s
    else
      s;
  findFirst =
    pred: default: list:
    let
      found = builtins.filter pred list;
    in
    if found == [ ] then default else builtins.head found;
  genAttrs = names: f: builtins.listToAttrs (map (n: { name = n; value = f n; }) names);
  optionals = cond: list: if cond then list else [ ];
  optionalAttrs = cond: attrs: if cond then attrs else { };
  concatStringsSep = builtins.concatStringsSep;
  makeBinPath = pkgs: concatStringsSep ":" (map (p: "${p.outPath}/bin") pkgs);
  getDev = p: p;
  getExe = p: "${p.outPath}/bin/${p.pname}";
  licenses = {
    mit = "mit";
    asl20 = "asl20";
  };
  fileset = {
    unions = paths: paths;
    toSource = { root, fileset }: { inherit root fileset; };
  };
}
