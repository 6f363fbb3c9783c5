"""Rules for the native (C++/CUDA/MUSA) sources and compiler flags a candidate hands to ``load_inline``.

Kept apart from the Python AST rules of ``static_checks`` because the text is C/C++, not Python: it is
lexed (comments, string literals, raw strings, line splices, adjacent literals) rather than parsed, and
``-D`` flags are read as ``#define`` lines, so what is matched is what the compiler will see. The
literal source texts and flags are collected by ``static_checks`` (which requires them to be literals);
this module only judges them.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Iterator


# Native (C++/CUDA/MUSA) sources are scanned in two views (``_native_views``): ``code`` has comments and
# string literals removed (identifier rules: no false hits in messages), ``full`` keeps the literals with
# adjacent ones merged (``"sys" "call"`` is ``"syscall"`` to the compiler). Both have line splices joined and
# whitespace around ``::`` removed. ``-D`` flags are scanned as ``#define`` lines.
#
# Functions whose use is a violation wherever they appear as identifiers (called, aliased through a macro or
# a flag, or taken by address), unless they are members (``x.clone``) or in a namespace other than std.
_NATIVE_FUNCS: dict[str, str] = {
    "file_access": "fopen freopen fdopen tmpfile tmpnam mkstemp mkostemp opendir fdopendir readdir scandir unlink "
                   "unlinkat rmdir mkdir mkdirat chmod fchmod fchmodat chown fchown lchown fchownat truncate "
                   "ftruncate open open64 openat openat2 creat rename renameat renameat2 symlink symlinkat link "
                   "linkat mknod mknodat mkfifo chdir fchdir chroot utime utimes "
                   # writing to (or rewiring) inherited descriptors: the harness's result channel is one
                   "write pwrite pwrite64 writev pwritev pwritev2 dup dup2 dup3 fcntl sendfile splice vmsplice tee "
                   "copy_file_range dprintf vdprintf pipe pipe2 close close_range closefrom",
    "network_access": "socket socketpair connect bind listen accept accept4 gethostbyname getaddrinfo sendto "
                      "recvfrom sendmsg recvmsg",
    "process_or_thread": "system popen fork vfork execl execlp execle execv execvp execvpe execve execveat fexecve "
                         "posix_spawn posix_spawnp clone clone3 _Fork forkpty wordexp kill tkill tgkill raise ptrace "
                         "prctl signal sigaction "
                         "setrlimit prlimit unshare setns setsid setpgid daemon alarm setitimer timer_create syscall "
                         "exit _exit _Exit quick_exit",
    # CPU-time usage (clocks are patterns below): only the harness times
    "timer_tampering": "getrusage",
    # process-wide policy the reference's timed calls share: its allocator, environment and scheduling
    "runtime_policy": "mallopt malloc_trim mallinfo mallinfo2 malloc_stats malloc_info sbrk brk setenv putenv "
                      "unsetenv clearenv mlock mlockall sched_setaffinity sched_setscheduler sched_setparam "
                      "setpriority nice",
    # (shared memory too: a forked helper's results reach the candidate through it)
    "dynamic_code": "dlopen dlsym dlmopen dlvsym dladdr dlinfo mmap mmap64 mprotect pkey_mprotect munmap mremap "
                    "madvise process_vm_readv process_vm_writev GetProcAddress shmget shmat shm_open memfd_create",
}
_NATIVE_FUNC_RULE = {name: rule for rule, names in _NATIVE_FUNCS.items() for name in names.split()}
# glibc exports the same functions as __name / __libc_name (__write, __libc_system) and 64-bit variants
_NATIVE_IDENT = re.compile(r"(?<![\w$])(?:__libc_|__)?(" + "|".join(sorted(_NATIVE_FUNC_RULE, key=len, reverse=True))
                           + r")(?:64)?(?![\w$])")
_NS_BEFORE = re.compile(r"(\w*)::$")

# BLAS routines libtorch exports (MKL): sgemm_/SGEMM always; plain sgemm only when declared extern "C" and
# not defined by the candidate (a kernel of its own may well be called sgemm)
_BLAS = ("(gemm|gemv|ger[cu]?|axpy|dot[cu]?|scal|copy|swap|nrm2|asum|trsm|trmm|symm|syrk|syr2k|hemm|herk|her2k"
         "|gbmv|symv|hemv|trmv|trsv|spmv)")
_PLAIN_BLAS = re.compile(r"(?<![\w.>:])([sdcz]" + _BLAS + r")\b")

# patterns on the code view (comments and string literals removed)
_NATIVE_CODE_PATTERNS: list[tuple[re.Pattern, str]] = [(re.compile(p), r) for p, r in [
    (r"\b(std::)?(i|o)?fstream\b|\bfilesystem::|\bFILE\s*\*|\b(basic_|stdio_|stdio_sync_)?filebuf\b|\b_IO_\w+"
     r"|\b__libc_\w+|\bio_uring\w*|\blio_listio\b", "file_access"),
    (r"\bcurl_\w+", "network_access"),
    (r"\bstd::(thread|jthread|async)\b|\b(std::)?j?thread\s+\w+\s*[({]|(?<![\w.>:])async\s*\(|\bpthread_\w+"
     r"|\bthrd_\w+|\b__gthread\w*|\bat::launch\b|\bintraop_launch\w*|\b\w*ThreadPool\b"
     # (intraop_launch_future too: it runs the task on a pool thread where ATen's threading is not OpenMP)
     r"|\bSIGEV_THREAD\b|\bsigev_notify\w*|\baio_\w+|\bstd::execution\b|\btbb::"
     r"|#\s*pragma\s+omp\b(?!\s+(simd|declare\s+simd)\b)"      # omp simd vectorises, it starts no threads
     r"|\b(omp|kmp)_\w+|\b(GOMP|gomp|__kmpc)_\w+|(?i:\w*set_num_threads)|\bsys(call|enter)\b|\bualarm\b",
     "process_or_thread"),
    (r"\bLoadLibrary\w*|\bPy[A-Z][A-Za-z0-9]*_\w+|\bPy_(?!ssize_t\b)\w+|\b_Py\w+|\bPyObject\b|\bTHP\w+|\.attr\s*\("
     r"|\b(py|pybind11)::(object|handle|module_?|reinterpret_borrow|reinterpret_steal|globals|eval|eval_file|exec"
     r"|import|getattr|setattr|hasattr|delattr|dict|list|tuple|str|bytes|capsule|cast|function|cpp_function|type"
     r"|isinstance|iterator|iterable|sequence|none|object_api|scoped_interpreter|gil_scoped_acquire"
     r"|gil_scoped_release|detail|print)\b|\btorch::(python|jit|utils|profiler|autograd::profiler)::",
     "dynamic_code"),
    (r"\b(cuda|musa|hip)StreamCreate\w*|\bgetStreamFromPool\b|\bgetStreamFromExternal\b"
     r"|\b(cuda|musa)StreamCreateWithPriority\b|\bcu(da)?StreamCreate\b|\bcuStreamCreate\w*", "stream_creation"),
    # registering kernels for ops that exist already: what TORCH_LIBRARY_IMPL expands to (a torch::Library of kind
    # IMPL, _TORCH_LIBRARY_IMPL, TorchLibraryInit) and the older RegisterOperators replace aten's kernels for the
    # reference too (a slow aten::relu made an honest relu kernel 45x faster than the reference it was timed against)
    (r"\bTORCH_LIBRARY_IMPL\b|\bTORCH_LIBRARY_FRAGMENT\b"
     r"|\bTORCH_LIBRARY\s*\(\s*(aten|prim|prims|mkldnn|mkl|quantized|_quantized|onednn|profiler)\b"
     r"|\bDispatcher\b|\bOperatorHandle\b|\bregisterKernel\b|\bLibrary\b|\b_TORCH_LIBRARY\w*|\bTorchLibraryInit\b"
     r"|\bRegisterOperators\b", "monkey_patching"),
    # ATen kernels called around the dispatcher (the profiler sees no op) and host math libraries
    (r"(?<![\w:])(at::)?(native|cpu|meta|_ops|redispatch|compositeexplicitautograd\w*|compositeimplicitautograd\w*"
     r"|cpublas|vml)::|\bnamespace\s+(native|cpu|meta|_ops|redispatch)\b|\bredispatch\w*|\bcblas_\w+"
     r"|\b(?i:[sdcz]" + _BLAS + r")_\b|\b[SDCZ](?-i:" + _BLAS.upper() + r")\b|\bi[sdcz]amax_\b|\bLAPACKE_\w+"
     r"|\b(mkl|MKL)_\w+|\bdnnl\w*|\bmkldnn\w*|\bideep::|\bopenblas_\w+", "host_compute"),
    # L2 residency that survives the flush between timed calls (CUDA/MUSA runtime and driver spellings)
    (r"\b(cuda|musa|cu|mu)StreamSetAttribute\b|\b(cuda|musa|cu|mu)GraphKernelNodeSetAttribute\b"
     r"|\w*AccessPolicyWindow\b|\baccessPolicyWindow\b|\b(cuda|musa)AccessProperty\w*|\b(CU|MU)_ACCESS_PROPERTY\w*"
     r"|\w*PersistingL2Cache\w*|\b(CU|MU)_LIMIT_PERSISTING\w*|\b(cuda|musa)DeviceSetLimit\b|\b(cu|mu)CtxSetLimit\b"
     r"|\b(hitProp|missProp|hitRatio|persistingL2CacheMaxSize)\b", "cache_persistence"),
    # timers and events of its own: only the harness times (and it captured its timer before the candidate)
    (r"\b(cuda|musa|hip)Event\w*|\b(cu|mu)Event\w*|\b(CU|MU)event\b|\b(CUDA|MUSA)Event\b|\bc10::Event\b"
     r"|\bclock_(gettime|settime|adjtime|getres)\b|\b(get|set)timeofday\b|\btimespec_get\b|\badjtimex\b"
     r"|\bchrono::|\b_{0,2}rdtscp?\b|\b__builtin_ia32_rdtscp?\b"
     r"|(?<![\w.>])(std::|::)?clock\s*\(|\bCLOCKS_PER_SEC\b", "timer_tampering"),   # the host's clock(), not clock64()
    # the profiler's state (RecordFunction callbacks are how it observes ops): a kernel that asks can tell a
    # profiled correctness trial from a timed call
    (r"\b\w*(hasCallbacks|hasGlobalCallbacks|hasThreadLocalCallbacks|RecordFunction|RECORD_FUNCTION|record_function"
     r"|[Pp]rofiler|ThreadLocalDebugInfo|ThreadLocalState|[Kk]ineto)\w*", "profiler_probe"),
    (r"\bSet(CPU|CUDA|MUSA)?Allocator\b|\bsetAllocator\w*|\w*CachingAllocator::(set\w*|emptyCache|init"
     r"|recordHistory|attach\w*)\b", "runtime_policy"),
    # the global context only as `globalContext().getter(...)`: a setter, or the context kept in a reference or
    # pointer (`auto& c = at::globalContext(); c.setSDPUseFlash(false)`), changes what the reference runs with
    (r"\bglobalContext\b(?:\s*\(\s*\)\s*\.\s*set\w*)?(?!\s*\(\s*\)\s*\.\s*(?!set)[A-Za-z_]\w*\s*\()|\bgetDefault\w*Generator\b|\bat::manual_seed\b",
     "global_torch_state"),
    (r"##|%:%:", "native_source"),                                      # token pasting (and its digraph)
    (r"[\w)\]]\s*(__asm__|__asm|asm)\s*\(|\b(section|weakref|alias|ifunc|symver)\s*\(|\\[uU][0-9A-Fa-f]{4}"
     r"|execstack", "native_source"),                                   # symbol aliases, code in data, UCNs
]]
# patterns on the full view (string literals kept, adjacent ones merged): include paths, asm text
_NATIVE_FULL_PATTERNS: list[tuple[re.Pattern, str]] = [(re.compile(p), r) for p, r in [
    (r"#\s*include\s*[<\"]\s*(/|\.\.|~)", "file_access"),
    (r"/proc/|/dev/(mem|kmem|shm)|/sys/", "file_access"),
    (r"#\s*include\s*[<\"]\s*ATen/(native/|ops/\w+_(native|\w*dispatch)\.h|\w*(CPU|CUDA|Meta|Composite\w*|Native"
     r"|Redispatch)Functions)", "host_compute"),
    (r"(?i:\bsys(call|enter)\b|\bint\s*\$?0x80\b)", "process_or_thread"),
    # PTX cache policies that keep lines resident (evict_last, createpolicy, applypriority)
    (r"\bevict_last\b|\bcreatepolicy\b|\bapplypriority\b|\bevict_unchanged\b", "cache_persistence"),
    (r"%globaltimer", "timer_tampering"),
    # OpenMP pragmas spelled with the _Pragma operator (the code view drops the string)
    (r"\b_Pragma\s*\(\s*\"\s*omp\b(?!\s+(simd|declare\s+simd)\b)", "process_or_thread"),
]]
# assembler directives that emit raw bytes or expand macros: only in a candidate whose native code has inline asm
# (a string like "indices must be torch.long" is no directive when nothing hands it to an assembler)
_ASM_DIRECTIVE = re.compile(r"\.(byte|word|quad|long|octa|2byte|4byte|8byte|incbin|inst|macro|rept|irp)\b")
# host inline asm on the cpu backend (its kernels are host code: asm there is raw machine code), and x86 control
# transfers to symbols or registers in any asm text on the others (PTX needs neither)
_HOST_ASM = re.compile(r"\b(__asm__|__asm|asm)\b")
_X86_TRANSFER = re.compile(r"(?i)\b(callq?|jmpq?)\s+\*?%?[A-Za-z_]")
# compiler / linker flags that load, alias or redirect code (tokens split on whitespace, commas and `=`);
# -fopenmp-simd only honours `omp simd` (vectorisation, no OpenMP runtime, no threads)
_BAD_FLAG = re.compile(r"^(-Wl(?=,|$)|-Xlinker|--?linker-options|-Xnvlink|--defsym|--wrap|-include|-imacros|--pre-include"
                       r"|-I|-isystem|-iquote|-idirafter|-iprefix|-iwithprefix|-isysroot|--sysroot|--include-path"
                       r"|-B|-ccbin|--compiler-bindir|-fplugin|-specs|--specs|-x|--x|-o|--output"
                       r"|-odir|--options-file|-optf|--run|-run|-z|-trigraphs|-wrapper|-save-temps|--save-temps"
                       r"|-fopenmp(?!-simd$)|-fuse-ld|-pthread|@)")
# load_inline requests for another backend's toolkit (the build would fail as a "toolchain problem")
_CUDA_HEADERS = re.compile(r"#\s*include\s*[<\"]\s*(cuda\w*\.h|cublas\w*|cudnn\w*|curand\w*|cusparse\w*|cufft\w*|nvrtc"
                           r"|nvToolsExt|thrust/|cub/|cooperative_groups|mma\.h|ATen/cuda/|c10/cuda/|cutlass/|cute/)")
_MUSA_HEADERS = re.compile(r"#\s*include\s*[<\"]\s*(musa\w*\.h|mublas\w*|mudnn\w*|murand\w*|ATen/musa/|c10/musa/"
                           r"|torch_musa/)")
_TOOLCHAIN_LIB = re.compile(r"^-l(cudart|cuda|c10\w*|torch\w*|musart|musa\w*|python\S*)$")
_BACKEND_LIBS = {"cpu": {"c10", "torch", "torch_cpu", "torch_python"},
                 "cuda": {"c10", "torch", "torch_cpu", "torch_python", "c10_cuda", "torch_cuda", "cudart", "cuda"}}
_DEFINE_FLAG = re.compile(r"(?:^|[\s,])-D\s*([A-Za-z_]\w*)(?:=(\S*))?")
_RAW_PREFIX = re.compile(r"(?:u8|u|U|L)?R\"([^\s()\\]{0,16})\(")


def toolchain_mismatches(requests: Iterable[tuple[str, Any]], texts: Iterable[str], flags: Iterable[str],
                         backend: str) -> list[str]:
    """What a candidate's load_inline calls ask for that this backend's toolchain lacks. ``requests`` are
    (argument, value) pairs; positional arguments are ``argN`` in torch's order (name, cpp, cuda, ...)."""
    found = []
    for key, value in requests:
        if backend == "cpu" and key in ("cuda_sources", "arg2") and value:
            found.append("cuda_sources, but the cpu backend compiles C++ only: write the kernel in cpp_sources")
        if backend == "cpu" and key == "with_cuda" and value:
            found.append("with_cuda=True, but the cpu backend has no CUDA toolkit: leave with_cuda out")
    headers = {"cpu": [_CUDA_HEADERS, _MUSA_HEADERS], "cuda": [_MUSA_HEADERS]}.get(backend, [])
    for text in texts:
        full = _native_views(text)[1]
        for pattern in headers:
            m = pattern.search(full)
            if m:
                end = re.compile(r'[>"\n]').search(full, m.end())
                include = full[m.start():end.end() if end and full[end.start()] != "\n" else m.end()].strip()
                kind = "MUSA" if pattern is _MUSA_HEADERS else "CUDA"
                fix = ("include only C++ and torch headers (torch/extension.h)" if backend == "cpu"
                       else "use the CUDA headers and runtime API")
                found.append(f"`{include}`, but the {backend} backend has no {kind} headers: {fix}")
    allowed = _BACKEND_LIBS.get(backend)
    for flag in flags:
        for lib in re.findall(r"(?:^|[\s,])-l\s*(\S+)", flag):
            m = _TOOLCHAIN_LIB.match("-l" + lib)
            if m and allowed is not None and m.group(1) not in allowed:
                found.append(f"`-l{lib}`, but the {backend} backend has no such library (it links "
                             f"{', '.join('-l' + x for x in sorted(allowed))})")
    return found


def _lex(text: str) -> Iterator[tuple[str, int, int, int, int]]:
    """A small C/C++ lexer: ``(kind, start, end, inner_start, inner_end)`` spans covering ``text``, kind
    ``comment``, ``str`` (string literals, with prefixes and raw strings; inner = the characters), ``char``
    or ``other`` (a run of code without spaces, or one space). ``1'000`` is a digit separator, not a char."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i) or text.startswith("/*", i):
            line = text[i + 1] == "/"
            j = text.find("\n" if line else "*/", i + 2)
            j = n if j < 0 else j + (0 if line else 2)
            yield "comment", i, j, i, j
            i = j
            continue
        prev = text[i - 1] if i else ""
        after_word = prev.isalnum() or prev == "_"
        raw = _RAW_PREFIX.match(text, i) if c in "uULR" and not after_word else None
        if raw:
            close = ")" + raw.group(1) + '"'
            j = text.find(close, raw.end())
            j = n if j < 0 else j
            yield "str", i, min(j + len(close), n), raw.end(), j
            i = j + len(close)
            continue
        if c == '"' or (c == "'" and not after_word):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            yield ("str" if c == '"' else "char"), i, min(j + 1, n), i + 1, min(j, n)
            i = j + 1
            continue
        j = i
        while j < n and text[j] not in "/\"'uULR" and not text[j].isspace():
            j += 1
        j = max(j, i + 1)
        yield "other", i, j, i, j
        i = j


def _native_views(text: str) -> tuple[str, str]:
    """(code, full) views of one native source; see above."""
    text = re.sub(r"\\\r?\n", "", text)   # line splices can split an identifier over two lines
    code: list[str] = []
    full: list[tuple[str, str]] = []       # (kind, text): kind "str" for literals, "ws", or "x"
    for kind, start, end, inner_start, inner_end in _lex(text):
        if kind == "comment":
            code.append(" ")
            full.append(("ws", " "))
        elif kind == "str":
            code.append('""')
            full.append(("str", text[inner_start:inner_end]))
        elif kind == "char":
            code.append("''")
            full.append(("x", "'" + text[inner_start:inner_end] + "'"))
        else:
            chunk = text[start:end]
            code.append(chunk)
            full.append(("ws" if chunk.isspace() else "x", chunk))
    merged: list[str] = []
    last_str = None            # index in `merged` of the last literal, while only whitespace follows it
    for kind, part in full:
        if kind == "str":
            if last_str is not None:
                del merged[last_str + 1:]
                merged[last_str] = merged[last_str][:-1] + part + '"'
                continue
            merged.append('"' + part + '"')
            last_str = len(merged) - 1
        elif kind == "ws":
            merged.append(part)
        else:
            merged.append(part)
            last_str = None
    ns = re.compile(r"\s*::\s*")
    return ns.sub("::", "".join(code)), ns.sub("::", "".join(merged))


# words before `::` or an identifier that are no namespace and no type
_KEYWORDS = {"return", "case", "goto", "throw", "sizeof", "new", "delete", "else", "do", "co_return", "co_yield",
             "typeid", "alignof", "decltype", "not", "and", "or"}
# a declarator of a variable or parameter named like a libc function: type words right after the start of a
# statement, parameter or member (`float signal = ...`, `(const bool& open)`, `std::vector<int> link;`), then `=`,
# `;`, `,`, `)`, `[`, `{` or a range-for `:`
_DECL_BEFORE = re.compile(r"(?:^|[;{}(,:])\s*(?:(?:const|volatile|static|constexpr|unsigned|signed|struct|enum|class"
                          r"|typename|register|thread_local|mutable|extern|inline|__restrict__|__shared__|__device__"
                          r"|__constant__|__managed__)\s+)*(?!(?:" + "|".join(sorted(_KEYWORDS)) + r")\b)[A-Za-z_][\w:]*"
                          r"(?:\s*<[^;{}()]*>)?(?:\s*(?:\*|&&|&|\bconst\b|\b__restrict__\b|\bvolatile\b))*\s*$")
_DECL_AFTER = re.compile(r"\s*(?:[=;,)\[{]|:(?!:))")


def _block_end(code: str, pos: int) -> int:
    """End of the scope a declaration at ``pos`` belongs to: the enclosing ``{}`` block, or for one inside
    parentheses (a parameter, a for/if initialiser) the body that follows them (or the statement up to ``;``)."""
    depth = {"(": 0, "{": 0}
    opener = None
    for i in range(pos - 1, -1, -1):
        c = code[i]
        if c in ")}":
            depth["(" if c == ")" else "{"] -= 1
        elif c in "({":
            if depth[c] == 0:
                opener = (c, i)
                break
            depth[c] += 1
    if opener is None:
        return len(code)
    kind, start = opener
    close = _matching(code, start)
    if kind == "{":
        return close
    nxt = re.compile(r"[{;]").search(code, close)
    if nxt is None:
        return len(code)
    return _matching(code, nxt.start()) if nxt.group() == "{" else nxt.start()


def _matching(code: str, start: int) -> int:
    """Index of the bracket closing the one at ``start`` (the end of ``code`` when it is never closed)."""
    pair = {"(": ")", "{": "}"}[code[start]]
    depth = 0
    for i in range(start, len(code)):
        if code[i] == code[start]:
            depth += 1
        elif code[i] == pair:
            depth -= 1
            if depth == 0:
                return i
    return len(code)


def _native_identifier_hits(code: str) -> Iterable[tuple[str, str]]:
    """(name, rule) for each use of a forbidden native function in the code view: a call (``name(``, also a
    function declaration), anything after ``::`` or in a ``#define`` (an alias), and any other use of the
    name as a value (``&system``, ``auto f = write;``) outside the scope of a variable of that name. A variable
    or parameter called ``signal``, ``open`` or ``write``, and its uses, are the candidate's own."""
    declared: dict[str, list[tuple[int, int]]] = {}     # name -> scopes of variables of that name
    hits = []
    for m in _NATIVE_IDENT.finditer(code):
        # a window cut mid-statement starts with a sentinel, so that its first characters are no statement start
        before = code[:m.start()] if m.start() <= 256 else "\0" + code[m.start() - 256:m.start()]
        stripped = before.rstrip()
        if stripped.endswith(".") or stripped.endswith("->"):
            continue   # a member: x.clone(), t->write
        ns = _NS_BEFORE.search(stripped)
        space = "" if ns is None or ns.group(1) in _KEYWORDS else ns.group(1)   # `return ::system(...)`
        if space not in ("", "std") or (space, m.group(1)) == ("std", "bind"):
            continue   # torch::clone, at::..., std::bind: another function of that name
        line = code[code.rfind("\n", 0, m.start()) + 1:m.start()]
        if ns or code[m.end():m.end() + 64].lstrip().startswith("(") or line.lstrip().startswith(("#", "%:")):
            yield m.group(1), _NATIVE_FUNC_RULE[m.group(1)]
            continue
        name = m.group(0)
        if _DECL_BEFORE.search(before) and _DECL_AFTER.match(code, m.end()):
            declared.setdefault(name, []).append((m.start(), _block_end(code, m.start())))
        else:
            hits.append(m)
    for m in hits:
        if not any(a <= m.start() <= b for a, b in declared.get(m.group(0), ())):
            yield m.group(1), _NATIVE_FUNC_RULE[m.group(1)]


def _blank(text: str, keep_strings: bool) -> str:
    """``text`` with comments (and, unless ``keep_strings``, the insides of literals) blanked out, lengths and
    line breaks kept: used only to say on which line of a native source a finding is."""
    out = list(text)
    for kind, start, end, inner_start, inner_end in _lex(text):
        if kind == "comment" or (kind in ("str", "char") and not keep_strings):
            a, b = (start, end) if kind == "comment" else (inner_start, inner_end)
            for k in range(a, b):
                if out[k] != "\n":
                    out[k] = " "
    return "".join(out)


def _locate(text: str, token: str, keep_strings: bool) -> int | None:
    """1-based line of the first occurrence of ``token`` in ``text`` outside comments (and literals), or None."""
    if not token:
        return None
    view = _blank(text, keep_strings)
    word = re.escape(token)
    if re.match(r"\w", token):
        word = r"(?<![\w$])" + word
    if re.search(r"\w$", token):
        word += r"(?![\w$])"
    m = re.search(word, view) or re.search(re.escape(token), text)
    return text.count("\n", 0, m.start()) + 1 if m else None


@dataclasses.dataclass(frozen=True)
class NativeFinding:
    """One problem of a candidate's native sources or flags: ``source`` indexes the scanned texts (None: the
    flags), ``line`` is the 1-based line in that text where it was found (None: unknown)."""
    rule: str
    evidence: str
    source: int | None = None
    line: int | None = None
    hint: str = ""


_OMP_HINT = "OpenMP may not start threads here; only `#pragma omp simd` (and -fopenmp-simd) is allowed"


def native_findings(texts: Iterable[str], flags: Iterable[str], backend: str) -> list[NativeFinding]:
    """Every native-source or flag problem of one candidate's load_inline calls, with where it was found."""
    found: list[NativeFinding] = []
    defines = []
    for flag in flags:
        # `=` and quotes too: -Xcompiler=-fopenmp, --compiler-options="-fopenmp" reach the host compiler
        for token in re.split(r"[\s,=]+", flag.strip()):
            token = token.strip("'\"")
            if token and _BAD_FLAG.match(token):
                found.append(NativeFinding("native_source", f"compiler flag `{token}`",
                                           hint=f"remove `{token}` from the load_inline flags"))
        defines += [f"#define {m.group(1)} {m.group(2) or ''}" for m in _DEFINE_FLAG.finditer(flag)]
    texts = list(texts)
    sources = len(texts)
    if defines:
        texts.append("\n".join(defines))
    views = [_native_views(t) for t in texts]
    any_asm = any(_HOST_ASM.search(code) for code, _ in views)

    def add(rule: str, evidence_token: str, index: int, keep_strings: bool, hint: str = "", evidence: str = "") -> None:
        src = index if index < sources else None
        line = _locate(texts[index], evidence_token, keep_strings) if src is not None else None
        found.append(NativeFinding(rule, evidence or f"`{evidence_token}`", src, line, hint))

    for index, (code, full) in enumerate(views):
        for name, rule in _native_identifier_hits(code):
            add(rule, name, index, False, f"`{name}` is a C library function that candidates may not use; if it is "
                                          "your own variable, function or macro, rename it")
            break
        if 'extern ""' in code:
            for m in _PLAIN_BLAS.finditer(code):
                if not re.search(r"\b" + m.group(1) + r"\s*\([^;{}]*\)\s*(const\s*)?\{", code):
                    add("host_compute", m.group(1), index, False, "write the matrix product in your own kernel",
                        f"`{m.group(1)}` (a BLAS routine declared extern \"C\")")
                    break
        for pattern, rule in _NATIVE_CODE_PATTERNS:
            m = pattern.search(code)
            if m:
                token = m.group(0).strip()
                add(rule, token, index, False, _OMP_HINT if "omp" in token else "")
        for pattern, rule in _NATIVE_FULL_PATTERNS:
            m = pattern.search(full)
            if m:
                token = m.group(0).strip()
                add(rule, token, index, True, _OMP_HINT if "omp" in token else "")
        if any_asm:
            m = _ASM_DIRECTIVE.search(full)
            if m:
                add("native_source", m.group(0), index, True, "inline asm may not emit data or macros (assembler "
                                                             "directives such as .byte/.long)")
        if backend == "cpu" and _HOST_ASM.search(code):
            m = _HOST_ASM.search(code)
            add("native_source", m.group(0), index, False, "the cpu backend allows no inline asm; write C++",
                "inline `asm` in host code")
        m = _X86_TRANSFER.search(full)
        if m and _HOST_ASM.search(code):
            add("native_source", m.group(0), index, True, "", f"asm `{m.group(0)}`")
    return found


def scan_native(texts: Iterable[str], flags: Iterable[str], backend: str) -> list[tuple[str, str]]:
    """(rule, evidence) for every native-source or flag problem of one candidate's load_inline calls."""
    return [(f.rule, f.evidence) for f in native_findings(texts, flags, backend)]
