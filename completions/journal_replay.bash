_journal_replay_completion() {
    local IFS=$'
'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \
                   COMP_CWORD=$COMP_CWORD \
                   _JOURNAL_REPLAY_COMPLETE=complete_bash $1 ) )
    return 0
}

complete -o default -F _journal_replay_completion journal_replay
