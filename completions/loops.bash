_loops_completion() {
    local IFS=$'\n'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \
                   COMP_CWORD=$COMP_CWORD \
                   _LOOPS_COMPLETE=complete_bash $1 ) )
    return 0
}

complete -o default -F _loops_completion loops
